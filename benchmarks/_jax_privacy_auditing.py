"""Load jax_privacy 2.0's auditing module without importing jax.

``jax_privacy/__init__.py`` imports the whole library (jax, chex, ...), but
``jax_privacy/auditing.py`` itself needs only numpy, scipy and dp_accounting. Install
with ``pip install --no-deps jax-privacy==2.0.0`` (so pip pulls neither jax nor another
torch) and load that one file by path. Returns None when jax_privacy is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def load():
    spec = importlib.util.find_spec("jax_privacy")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "auditing.py")
    name = "_jax_privacy_auditing_standalone"
    if name in sys.modules:
        return sys.modules[name]
    mspec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[name] = mod
    mspec.loader.exec_module(mod)
    return mod
