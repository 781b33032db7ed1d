"""Warnings the autodp seeds' code raises by design, ignored by the tests that run it."""

from __future__ import annotations

import pytest

#: the seeds' autodp code asks for improved_bound_flag=True, which the facade notes it
#: does not need (the notice is tested in test_conformance_autodp_tests); autodp's
#: own scalar optimiser (the peer) divides by zero on its search's flat stretches
SEED_CODE_WARNINGS = [
    pytest.mark.filterwarnings(
        "ignore:AmplificationBySampling. improved_bound_flag=True has no effect"
        ":privlearn.errors.AutodpArgumentWarning"
    ),
    pytest.mark.filterwarnings(
        "ignore:invalid value encountered in scalar divide:RuntimeWarning:scipy.optimize"
    ),
]
