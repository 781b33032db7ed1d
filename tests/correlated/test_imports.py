"""privlearn.correlated depends only on NumPy, SciPy and privlearn's accounting layer and
shared leaves (validation, errors, the type registry, the progress bar; the PyTorch side
builds on it, never the reverse)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import privlearn.correlated

PKG = Path(privlearn.correlated.__file__).parent
ALLOWED = ("numpy", "scipy", "privlearn.accounting", "privlearn._validation", "privlearn.errors",
           "privlearn._type_registry", "privlearn._progress", "privlearn.correlated")


def test_imports_point_inward():
    bad = []
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names:
                    continue
                if not any(name == a or name.startswith(a + ".") for a in ALLOWED):
                    bad.append(f"{path.name}: {name}")
    assert not bad, bad


def test_imports_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import privlearn.correlated, privlearn.correlated.accounting\n"
        "import privlearn.correlated.noise, privlearn.correlated.sampling\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
