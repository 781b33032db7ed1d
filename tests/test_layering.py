"""Dependencies point inward: accounting and models never import torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import privlearn

PKG = Path(privlearn.__file__).parent
ALLOWED_THIRD_PARTY = {"numpy", "scipy"}


# ``sys.modules["torch"] = None`` is the usual way to hide a package, but SciPy's array-API
# helpers (imported by scipy.stats / scipy.signal / scikit-learn) treat any "torch" key in
# sys.modules as an imported torch and crash on the None. So we hide torch as an absent
# installation does: a meta-path finder that makes every ``import torch`` fail.
_BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked by test_layering")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH + code], capture_output=True, text=True, timeout=180
    )


def test_torch_blocker_works():
    res = _run("import torch\n")
    assert res.returncode != 0 and "blocked by test_layering" in res.stderr


def test_accounting_and_models_import_without_torch():
    code = (
        "import privlearn.accounting as acc\n"
        "m = acc.compose(acc.subsample(acc.Gaussian(1.0), 0.01), 100)\n"
        "assert m.epsilon(1e-5, accountant='rdp') > 0\n"
        "assert m.epsilon(1e-5, accountant='pld') > 0\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('privlearn.models') is not None:\n"
        "    import privlearn.models\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")


def test_accounting_imports_with_torch_set_to_none():
    # the literal sys.modules["torch"] = None form, for the modules that do not pull in
    # scipy.stats / scipy.signal (see the note above; the registry imports pld, which does)
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import privlearn.accounting as acc\n"
        "from privlearn.accounting import analytic, rdp\n"
        "from privlearn.accounting.conversion import rdp_to_epsilon\n"
        "m = acc.compose(acc.subsample(acc.Gaussian(1.0), 0.01), 100)\n"
        "assert rdp_to_epsilon(lambda a: rdp.rdp_epsilon(m, a), 1e-5) > 0\n"
        "assert analytic.gaussian_epsilon(1.0, 1e-5) > 0\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_accounting_imports_only_numpy_scipy_stdlib():
    files = sorted((PKG / "accounting").rglob("*.py"))
    assert files
    offenders = {}
    for f in files:
        bad = {
            r
            for r in _imported_roots(f)
            if r not in sys.stdlib_module_names
            and r not in ALLOWED_THIRD_PARTY
            and r != "privlearn"
        }
        if bad:
            offenders[str(f.relative_to(PKG))] = sorted(bad)
    assert not offenders, f"privlearn.accounting must import only numpy/scipy/stdlib: {offenders}"


def test_accounting_imports_no_other_privlearn_subpackage():
    offenders = {}
    for f in sorted((PKG / "accounting").rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            for mod in mods:
                if mod.startswith("privlearn") and not (
                    mod == "privlearn.accounting" or mod.startswith("privlearn.accounting.")
                ):
                    offenders.setdefault(str(f.relative_to(PKG)), []).append(mod)
    assert not offenders, offenders
