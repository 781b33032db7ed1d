"""Generate the API reference: one page per public name of each documented package.

The list of documented packages is :data:`API_PACKAGES` (the one place to edit). For each
package, the public names are its ``__all__``; every name gets its own page
``api/generated/<package>.<name>.rst`` (autodoc), and each package a summary page
``api/generated/<package>.rst``. ``docs/conf.py`` runs :func:`generate` before every
build; ``tests/test_docs.py`` checks that the built site has an entry for every name.

A listed package that is not part of this checkout (e.g. a package still being written on
another branch), or whose optional dependency is not installed (:data:`REQUIRES`: the
``torch`` and ``hf`` extras), is skipped with a message on the console; a package that
exists, has its dependencies and fails to import stops the build.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

#: The packages whose public names (``__all__``) the reference documents, in order.
#: Add a package here and it gets a reference section; add a name to a package's
#: ``__all__`` and it gets a page (tests/test_docs.py fails if it does not).
API_PACKAGES: list[str] = [
    "privlearn.accounting",
    "privlearn.accounting.pairs",
    "privlearn.accounting.serialization",
    "privlearn.accounting.fdp",
    "privlearn.correlated",
    "privlearn.models",
    "privlearn.models.base",
    "privlearn.models.constraints",
    "privlearn.torch",
    "privlearn.torch.grad_sample",
    "privlearn.torch.hf",
    "privlearn.auditing",
    "privlearn.auditing.torch",
    "privlearn.auditing.models",
    "privlearn.ledger",
    "privlearn.errors",
    "privlearn.datasets",
    "privlearn.experiments",
    "privlearn.compat.autodp",
    "privlearn.compat.dp_events",
]

#: Optional dependency of a documented package (the module that must be importable): a
#: package whose dependency is missing is skipped like an absent one, so the reference
#: builds without the ``torch`` and ``hf`` extras.
REQUIRES: dict[str, str] = {
    "privlearn.torch": "torch",
    "privlearn.torch.grad_sample": "torch",
    "privlearn.torch.hf": "transformers",
    "privlearn.auditing.torch": "torch",
}

HERE = Path(__file__).resolve().parent
OUT = HERE / "api" / "generated"


def present_packages() -> tuple[list[str], list[str]]:
    """(packages of :data:`API_PACKAGES` that can be documented here, the others).

    Presence is decided on the file system, next to the ``privlearn`` package being
    documented (an import-system lookup could find a different, installed copy); a
    package is also left out when its optional dependency (:data:`REQUIRES`) is not
    installed."""
    import privlearn

    base = Path(privlearn.__file__).resolve().parent
    present, absent = [], []
    for name in API_PACKAGES:
        rel = Path(*name.split(".")[1:])
        found = (base / rel / "__init__.py").is_file() or (base / rel).with_suffix(".py").is_file()
        if found and name in REQUIRES:
            found = importlib.util.find_spec(REQUIRES[name]) is not None
        (present if found else absent).append(name)
    return present, absent


def public_names(package: str) -> list[str]:
    """The package's ``__all__`` (which every documented package must define)."""
    mod = importlib.import_module(package)
    names = getattr(mod, "__all__", None)
    if names is None:
        raise RuntimeError(f"{package} has no __all__; the API reference needs one")
    return list(names)


def _directive(obj: object) -> tuple[str, list[str]]:
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return "autoexception", [":members:", ":show-inheritance:"]
        return "autoclass", [":members:", ":show-inheritance:"]
    if callable(obj):
        return "autofunction", []
    return "autodata", [":no-value:"]


def _title(text: str) -> str:
    return f"{text}\n{'=' * len(text)}\n"


def generate(out: Path = OUT) -> dict[str, list[str]]:
    """Write the reference pages; returns package -> documented names."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.rst"):
        old.unlink()
    present, _ = present_packages()
    documented: dict[str, list[str]] = {}
    for package in present:
        mod = importlib.import_module(package)
        names = public_names(package)
        documented[package] = names
        summary = (mod.__doc__ or "").strip().splitlines()[0] if mod.__doc__ else ""
        lines = [f".. _api-{package}:", "", _title(package), f".. py:module:: {package}",
                 "", summary, "", f".. currentmodule:: {package}", "", ".. list-table::",
                 "   :widths: 30 70", ""]
        for name in names:
            obj = getattr(mod, name)
            doc = inspect.getdoc(obj) if not isinstance(obj, (int, float, str, tuple, list,
                                                               dict, frozenset)) else None
            first = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
            lines += [f"   * - :doc:`{name} <{package}.{name}>`", f"     - {_escape(first)}"]
        lines += ["", ".. toctree::", "   :hidden:", ""]
        lines += [f"   {package}.{name}" for name in names]
        (out / f"{package}.rst").write_text("\n".join(lines) + "\n")
        for name in names:
            directive, options = _directive(getattr(mod, name))
            page = [_title(f"{package}.{name}"), f".. currentmodule:: {package}", "",
                    f".. {directive}:: {name}"] + [f"   {o}" for o in options]
            (out / f"{package}.{name}.rst").write_text("\n".join(page) + "\n")
    index = [_title("API reference"),
             "One page per public name (the ``__all__`` of each package).", "",
             ".. toctree::", "   :maxdepth: 1", ""]
    index += [f"   {package}" for package in documented]
    (out / "index.rst").write_text("\n".join(index) + "\n")
    return documented


def _escape(text: str) -> str:
    """A docstring's first paragraph as safe inline text for the summary table (roles and
    markup kept, but a trailing colon or an unmatched backquote cannot break the table)."""
    if text.count("``") % 2 or text.count("`") % 2:
        text = text.replace("`", "")
    return text.rstrip(":")
