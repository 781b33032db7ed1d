"""The PyTorch versions :mod:`privlearn.torch` supports, checked when it is imported.

The range is the ``torch`` extra's (``pyproject.toml``: ``torch>=2.11,<3``, a test checks
that the two agree): from the oldest PyTorch the engine has run on (2.11, with CUDA) to
below the next major version, so that ``pip install privlearn[torch]`` keeps a PyTorch the
user already has. Outside it :mod:`privlearn.torch` refuses to import (``ImportError``):
the engine relies on a few PyTorch internals (autograd's current graph task, storage use
counts, ``GradScaler``'s per-optimizer state) whose behaviour it has only been checked
against in this range. A release newer than the newest one the test suite runs on
(:data:`TESTED`, the ``torch==2.13.0`` that CI installs) is accepted with one
:class:`UntestedTorchWarning`.

:func:`check_torch_internals` then checks that the few PyTorch internals every private
step uses exist (:data:`REQUIRED_INTERNALS`), so that a PyTorch without one is refused at
import, naming it, rather than failing in the middle of training.

Versions are compared as PEP 440 orders them, on the release numbers: local labels
(``+cpu``, ``+cu128``) are ignored; a pre-release or development build of 2.11.0 comes
before 2.11.0 and is refused, as ``pip`` refuses it for ``>=2.11``; one of 3.0.0 is
refused as ``<3`` refuses it.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import warnings

import torch

from privlearn.errors import ParameterValueError, UntestedTorchWarning

#: The oldest supported release, ``(major, minor)``.
OLDEST_SUPPORTED: tuple[int, int] = (2, 11)
#: The PyTorch the test suite runs on: ``.ci/run`` installs exactly this CPU build.
TESTED: str = "2.13.0"
#: The first unsupported major version.
NEXT_MAJOR: int = 3
#: The range as a requirement specifier (the ``torch`` extra's).
SUPPORTED_RANGE = f">={OLDEST_SUPPORTED[0]}.{OLDEST_SUPPORTED[1]},<{NEXT_MAJOR}"

_VERSION = re.compile(
    r"\s*v?(?P<release>\d+(?:\.\d+)+)"                         # 2.13.0
    r"(?P<pre>(?:[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?\d*)?)"
    r"(?P<post>(?:[-_.]?(?:post|rev|r)[-_.]?\d*)?)"
    r"(?P<dev>(?:[-_.]?dev[-_.]?\d*)?)"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?\s*$",                # +cpu, +cu128, +git1a2b3c
    re.IGNORECASE)


def _release(version: str) -> tuple[tuple[int, int, int], bool]:
    """``((major, minor, micro), before)`` of a PEP 440 version string, ``before`` telling
    whether it orders before the plain release ``major.minor.micro`` (a pre-release, or a
    development release that is not one of a post-release: PEP 440, "Summary of permitted
    suffixes and relative ordering")."""
    m = _VERSION.match(version)
    if m is None:
        raise ParameterValueError(
            f"version must be a PEP 440 version string such as '2.13.0' or '2.13.0+cpu', "
            f"got {version!r}; pass torch.__version__ or leave version unset")
    parts = [int(x) for x in m["release"].split(".")] + [0, 0]
    before = bool(m["pre"]) or (bool(m["dev"]) and not m["post"])
    return (parts[0], parts[1], parts[2]), before


#: The newest release series the test suite runs on, ``(major, minor)``.
NEWEST_TESTED: tuple[int, int] = _release(TESTED)[0][:2]
_warned: set[str] = set()  # versions already warned about in this process

_INSTALL = ("Install a supported PyTorch first, then privlearn: "
            f'`pip install "torch{SUPPORTED_RANGE}"` from the index of your CUDA version '
            f"(https://pytorch.org/get-started/locally/), or `pip install torch=={TESTED} "
            "--index-url https://download.pytorch.org/whl/cpu` for the CPU build")


def check_torch_version(version: str | None = None) -> None:
    """Refuse a PyTorch outside :data:`SUPPORTED_RANGE`; warn once for one newer than tested.

    Parameters
    ----------
    version : str, optional
        A PyTorch version string (``torch.__version__`` when omitted), e.g. ``"2.13.0+cpu"``.

    Raises
    ------
    ImportError
        The version is older than :data:`OLDEST_SUPPORTED` (a pre-release of it included),
        of major version :data:`NEXT_MAJOR` or later, or not a version string.

    Warns
    -----
    UntestedTorchWarning
        The version is in the range but newer than :data:`NEWEST_TESTED` (once per
        version and process).
    """
    found = str(torch.__version__ if version is None else version)
    supported = (f"privlearn.torch supports PyTorch {SUPPORTED_RANGE} (its test suite runs "
                 f"on {TESTED})")
    try:
        release, before = _release(found)
    except ParameterValueError:
        raise ImportError(f"{supported}; the installed torch reports the version {found!r}, "
                          f"which is not a version number. {_INSTALL}") from None
    oldest = (*OLDEST_SUPPORTED, 0)
    if release < oldest or (release == oldest and before):
        raise ImportError(f"{supported}; the installed torch is {found}, which is older "
                          f"than {oldest[0]}.{oldest[1]}.0. {_INSTALL}")
    if release[0] >= NEXT_MAJOR:
        raise ImportError(f"{supported}; the installed torch is {found}, a major version "
                          f"privlearn does not support yet. {_INSTALL}")
    if release[:2] > NEWEST_TESTED and found not in _warned:
        _warned.add(found)
        warnings.warn(f"{supported}; torch {found} is newer than any version privlearn is "
                      "tested on. It is expected to work; if something fails, pin "
                      f'"torch<{release[0]}.{release[1]}" and report it',
                      UntestedTorchWarning, stacklevel=2)


def _resolves(path: str) -> bool:
    """Whether ``"module:attr.attr"`` names something in this PyTorch."""
    module, _, rest = path.partition(":")
    if importlib.util.find_spec(module) is None:
        return False
    obj = importlib.import_module(module)
    for name in rest.split("."):
        obj = getattr(obj, name, _MISSING)
        if obj is _MISSING:
            return False
    return True


_MISSING = object()

#: PyTorch internals that every private step uses (no public API does the same), each
#: with where and why: a PyTorch without one is refused at import, naming it, rather than
#: failing in the middle of training. Internals that only some features use are not
#: checked here, so as not to refuse users who do not need them: storage use counts are
#: guarded where used (unknown counts: a fresh noise buffer every step); ``GradScaler``'s
#: ``_scale`` and ``_per_optimizer_states`` are used only when a scaler drives the step.
REQUIRED_INTERNALS: dict[str, str] = {
    "torch:_C._current_graph_task_id": "tracker.py: whether autograd runs a backward pass",
    "torch.autograd:Variable._execution_engine.queue_callback":
        "tracker.py: a callback at the end of the backward pass",
    "torch.utils._pytree:tree_flatten": "tracker.py, data.py, fallback.py",
    "torch.utils._pytree:tree_unflatten": "tracker.py, data.py",
    "torch.utils._pytree:tree_map": "data.py",
}


def check_torch_internals() -> None:
    """Refuse a PyTorch that lacks one of :data:`REQUIRED_INTERNALS`.

    Raises
    ------
    ImportError
        Naming each internal that is missing, the installed version and the range.
    """
    missing = [f"{path.replace(':', '.')} ({why})"
               for path, why in REQUIRED_INTERNALS.items() if not _resolves(path)]
    if missing:
        raise ImportError(
            f"privlearn.torch needs PyTorch internals that torch {torch.__version__} does not "
            f"have: {'; '.join(missing)}. It supports PyTorch {SUPPORTED_RANGE} (its test "
            f"suite runs on {TESTED}). {_INSTALL}")


check_torch_version()
check_torch_internals()
