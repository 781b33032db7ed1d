"""privlearn.auditing imports only NumPy/SciPy at import time (torch lazily)."""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
        return None
sys.meta_path.insert(0, _NoTorch())
import numpy as np
import privlearn.auditing as a
from privlearn.auditing import harness, bounds, models, report  # noqa: F401
lab = np.arange(400) < 200
s = lab * 3.0 + np.random.default_rng(0).normal(size=400)
for m in a.METHODS:
    assert a.epsilon_lower_bound(s[lab], s[~lab], delta=1e-5, method=m) > 0
heavy = [m for m in ("torch", "matplotlib", "sklearn", "privlearn.torch") if m in sys.modules]
assert not heavy, heavy
try:
    import privlearn.auditing.torch
except ImportError as e:
    assert "blocked" in str(e)
else:
    raise AssertionError("privlearn.auditing.torch imported without torch")
print("ok")
"""


def test_auditing_imports_without_torch():
    res = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")
