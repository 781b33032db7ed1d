"""Shared test configuration.

Hypothesis: under CI (``CI`` set) examples are derandomized, so a CI run is reproducible;
locally they are random, which keeps finding new cases. ``HYPOTHESIS_PROFILE`` overrides.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# MNIST is found only in documented places (privlearn.datasets): point PRIVLEARN_DATA at the
# project's shared data directory when the checkout sits beside one, so the MNIST tests run
# there; elsewhere they skip.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _cand in (os.path.join(_root, "shared", "data"),
              os.path.join(os.path.dirname(_root), "shared", "data")):
    if os.path.isdir(os.path.join(_cand, "mnist")):
        os.environ.setdefault("PRIVLEARN_DATA", _cand)
        break


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests (they need a CUDA device) skip, with the reason, where
    torch or CUDA is not available; ``-m gpu`` selects them on a machine with one."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        skip = pytest.mark.skip(reason="needs a CUDA device (marker gpu)")
        for item in gpu:
            item.add_marker(skip)
