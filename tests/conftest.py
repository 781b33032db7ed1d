"""Shared test configuration.

Hypothesis: under CI (``CI`` set) examples are derandomized, so a CI run is reproducible;
locally they are random, which keeps finding new cases. ``HYPOTHESIS_PROFILE`` overrides.
"""

import os
import time

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


class _Stopwatch:
    """``with stopwatch() as t: ...`` then ``t.seconds``: the smaller of the block's wall
    time and this process's CPU time. A loaded machine (other processes, xdist workers
    sharing two cores) inflates the wall time, not the CPU time; idle-spinning BLAS
    threads on a many-core machine inflate the CPU time, not the wall time: the minimum
    measures the work itself, so a time budget fails on a slow algorithm, not by chance."""

    def __enter__(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.seconds = min(time.perf_counter() - self._wall, time.process_time() - self._cpu)


@pytest.fixture
def stopwatch():
    """The class :class:`_Stopwatch`, for a test's time budget."""
    return _Stopwatch
