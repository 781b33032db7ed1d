"""The PyTorch version check at ``import privlearn.torch``: an unsupported PyTorch is
refused with an ImportError naming the supported range, one newer than tested warns once.

The rule is checked against ``packaging`` (PEP 440's reference implementation): a version
is accepted exactly when ``packaging`` puts it in the ``torch`` extra's range, and warned
about exactly when it comes after the tested release series."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
packaging_version = pytest.importorskip("packaging.version")
packaging_specifiers = pytest.importorskip("packaging.specifiers")

from privlearn.torch import _version  # noqa: E402
from privlearn.torch._version import (  # noqa: E402
    NEWEST_TESTED,
    SUPPORTED_RANGE,
    TESTED,
    UntestedTorchWarning,
    check_torch_version,
)

ROOT = Path(__file__).resolve().parents[2]
Version = packaging_version.Version
SpecifierSet = packaging_specifiers.SpecifierSet


def _outcome(version: str) -> str:
    """'refused', 'warned' or 'accepted' (a fresh process: no version warned about yet)."""
    _version._warned.discard(version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_torch_version(version)
        except ImportError as e:
            msg = str(e)
            assert SUPPORTED_RANGE in msg and version in msg, msg
            assert "pip install" in msg, msg
            return "refused"
    ours = [w for w in caught if issubclass(w.category, UntestedTorchWarning)]
    assert len(ours) <= 1
    if ours:
        assert version in str(ours[0].message) and TESTED in str(ours[0].message)
    return "warned" if ours else "accepted"


def _pep440_outcome(version: str) -> str:
    v = Version(version)
    if v not in SpecifierSet(SUPPORTED_RANGE, prereleases=True):
        return "refused"
    next_series = Version(f"{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}.dev0")
    return "warned" if v >= next_series else "accepted"


@pytest.mark.parametrize("version, expected", [
    ("1.13.1", "refused"),
    ("2.10.2+cu126", "refused"),
    ("2.11.0rc1", "refused"),            # before 2.11.0 (pip refuses it for >=2.11 too)
    ("2.11.0a0+gitabc1234", "refused"),  # a source build made before 2.11 was released
    ("3.0.0", "refused"),
    ("3.0.0a0", "refused"),
    ("3.1.0+cpu", "refused"),
    ("2.11.0", "accepted"),
    ("2.11.0+cu128", "accepted"),        # the GPU build the engine ran on
    ("2.12.1", "accepted"),
    ("2.12.0.dev20260301+cpu", "accepted"),
    ("2.13.0+cpu", "accepted"),
    ("2.13.1", "accepted"),
    ("2.11.0.post1.dev0", "accepted"),   # after 2.11.0 (a post-release's dev build)
    ("2.11.0.dev20260101", "refused"),
    ("2.14.0", "warned"),
    ("2.14.1+cu130", "warned"),
    ("2.15.0a0+gitabc1234", "warned"),
])
def test_versions_are_refused_accepted_or_warned(version, expected):
    assert _pep440_outcome(version) == expected  # the table agrees with PEP 440
    assert _outcome(version) == expected


@pytest.mark.parametrize("version", ["", "nightly", "2", "2.x.0", "two.thirteen"])
def test_unreadable_version_is_refused(version):
    with pytest.raises(ImportError, match=re.escape(SUPPORTED_RANGE)) as e:
        check_torch_version(version)
    assert repr(version) in str(e.value)


_pre = st.sampled_from(["", "a0", "a1", "b2", "rc1", "rc2"])
_dev = st.sampled_from(["", ".dev0", ".dev20260301"])
_post = st.sampled_from(["", ".post1"])
_local = st.sampled_from(["", "+cpu", "+cu128", "+git1a2b3c4", "+rocm6.3"])


@given(major=st.integers(0, 4), minor=st.integers(0, 20), micro=st.integers(0, 3),
       pre=_pre, post=_post, dev=_dev, local=_local)
def test_rule_is_pep440_order_on_the_extra_range(major, minor, micro, pre, post, dev, local):
    version = f"{major}.{minor}.{micro}{pre}{post}{dev}{local}"
    assert _outcome(version) == _pep440_outcome(version)


def test_monkeypatched_torch_version_is_what_is_checked(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.raises(ImportError, match=r"installed torch is 2\.10\.0"):
        check_torch_version()
    monkeypatch.setattr(torch, "__version__", "3.0.0")
    with pytest.raises(ImportError, match=r"installed torch is 3\.0\.0"):
        check_torch_version()


def test_newer_than_tested_warns_once_per_version(monkeypatch):
    monkeypatch.setattr(_version, "_warned", set())
    monkeypatch.setattr(torch, "__version__", "2.99.0+cu130")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            check_torch_version()
    assert [w.category for w in caught] == [UntestedTorchWarning]


_IMPORT_SCRIPT = """
import warnings
import torch
torch.__version__ = "2.10.0"
try:
    import privlearn.torch
except ImportError as e:
    print("REFUSED", e)
else:
    print("IMPORTED")
torch.__version__ = "2.14.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import privlearn.torch
    from privlearn.torch import make_private  # noqa: F401
    from privlearn.torch._version import check_torch_version
    check_torch_version()
print("WARNINGS", sum("newer than any version" in str(w.message) for w in caught))
"""


def test_import_of_privlearn_torch_runs_the_check():
    """In a fresh process: the old version is refused at ``import privlearn.torch`` (and
    nothing is left half-imported: the next import, with a newer torch, succeeds), the
    newer one warns exactly once."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _IMPORT_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("REFUSED") and SUPPORTED_RANGE in lines[0], p.stdout
    assert "2.10.0" in lines[0]
    assert lines[-1] == "WARNINGS 1", p.stdout


def _torch_extra() -> list[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return meta["project"]["optional-dependencies"]["torch"]


def test_torch_extra_is_the_supported_range_not_a_pin():
    (req,) = _torch_extra()
    m = re.fullmatch(r"torch\s*(?P<spec>[^;]*)", req)
    assert m, req
    spec = SpecifierSet(m["spec"])
    assert spec == SpecifierSet(SUPPORTED_RANGE)
    assert not any(s.operator in ("==", "===", "~=") for s in spec)
    assert {s.operator for s in spec} == {">=", "<"}
    assert Version(TESTED) in spec and Version(str(torch.__version__)) in spec


def test_ci_and_readme_install_the_tested_cpu_build_first():
    """The exact pin lives in CI and the test command only, before the extras."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    first_install = f"pip install torch=={TESTED} && pip install -e \".[torch,"
    assert first_install in ci and first_install in readme
    pins = set(re.findall(r"torch==(\d+(?:\.\d+)*)", ci + readme))
    assert pins == {TESTED}, pins


# ------------------------------------------------------------- version-dependent paths
def test_present_internals_pass_and_each_missing_one_is_named(monkeypatch):
    _version.check_torch_internals()  # this torch has them all
    import torch.utils._pytree as pytree

    for owner, name, shown in [(torch._C, "_current_graph_task_id", "_current_graph_task_id"),
                               (pytree, "tree_map", "torch.utils._pytree.tree_map"),
                               (torch.autograd.Variable, "_execution_engine",
                                "_execution_engine.queue_callback")]:
        with monkeypatch.context() as m:
            m.delattr(owner, name)
            with pytest.raises(ImportError, match=re.escape(shown)) as e:
                _version.check_torch_internals()
            assert SUPPORTED_RANGE in str(e.value) and str(torch.__version__) in str(e.value)


def _tiny_engine(seed=0):
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    torch.manual_seed(seed)
    x, y = torch.randn(48, 6, 8), torch.randint(0, 2, (48,))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=12),
                        noise_multiplier=1.0, max_grad_norm=1.0, seed=1)


def _train(p, steps=4):
    """Train ``steps`` steps, keeping each step's gradients and a copy of them."""
    held = []
    for _, (xb, yb) in zip(range(steps), p.data_loader, strict=False):
        p.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(p.model(xb).mean(1), yb).backward()
        p.optimizer.step()
        held.append([(q.grad, q.grad.clone()) for q in p.model.parameters()])
    return held


def test_without_storage_use_counts_the_noise_buffer_is_never_reused(monkeypatch):
    """A PyTorch without ``torch._C._storage_Use_Count``: the optimizer cannot tell that
    nobody holds last step's noisy gradients, so it takes a fresh buffer every step (never
    writes into memory someone may hold) and trains exactly as with the count."""
    ref = _tiny_engine()
    _train(ref)
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    p = _tiny_engine()
    held = _train(p)
    for step in held:  # the gradients handed out at each step were never changed after it
        for grad, copy in step:
            assert torch.equal(grad, copy)
    from privlearn.torch.optimizer import _sole_owner

    assert not _sole_owner(torch.empty(3))  # unknown counts as shared
    for a, b in zip(p.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(a, b)
