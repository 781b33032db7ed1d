"""The ``>>>`` examples of the package's docstrings run, as the documentation pages' code
blocks do (tests/test_docs.py): a reader who pastes an example from ``help(...)`` or from
an API reference page gets what it shows. Each module with an example is one test; a
module whose examples are fragments (they use the reader's own model and data) is listed
in ``FRAGMENTS`` with the reason, as a page's ``docs-test: skip`` block is.
"""

from __future__ import annotations

import doctest
import importlib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "privlearn"

#: Modules whose examples do not run on their own, with the reason.
FRAGMENTS = {
    "privlearn.torch.hf": "a fragment: it uses the reader's own model, data and collator",
}
#: Modules that need an optional dependency, by the module it imports.
NEEDS = {"privlearn.torch": "torch", "privlearn.auditing.torch": "torch"}


def _modules_with_examples() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>> " not in path.read_text():
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


MODULES = _modules_with_examples()


def test_modules_with_examples_are_found() -> None:
    assert len(MODULES) >= 10
    assert "privlearn.ledger" in MODULES and "privlearn.accounting" in MODULES
    for name in FRAGMENTS:  # a fragment listed here still has its example
        assert name in MODULES, f"{name}: listed in FRAGMENTS but has no example"


@pytest.mark.parametrize("name", [m for m in MODULES if m not in FRAGMENTS])
def test_docstring_examples_run(name: str, tmp_path: Path, monkeypatch) -> None:
    for prefix, dependency in NEEDS.items():
        if name == prefix or name.startswith(prefix + "."):
            pytest.importorskip(dependency)
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    from privlearn.errors import PrivacyLeakWarning

    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name}: no example found"
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)  # no example teaches a leak
        for test in tests:
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
