"""The strategy optimisers: a progress bar on standard error when asked, one
computation per set of public settings, and a warning when bands go unused."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from privlearn.correlated import (
    MinSeparation,
    MomentumPrefixSum,
    PrefixSum,
    SingleParticipation,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
)
from privlearn.correlated import optimize as opt
from privlearn.correlated.error import Workload
from privlearn.errors import ParameterTypeError, StrategyAdjustedWarning


@pytest.fixture(autouse=True)
def _fresh_memo():
    optimize_banded_toeplitz.cache_clear()
    yield
    optimize_banded_toeplitz.cache_clear()


@pytest.mark.parametrize("optimise", [
    lambda **kw: optimize_banded_toeplitz(128, 6, MinSeparation(16), **kw),
    lambda **kw: optimize_blt(128, 2, **kw),
])
def test_progress_forced_on_goes_to_stderr_and_changes_nothing(capsys, optimise):
    quiet = optimise(show_progress=False)
    assert capsys.readouterr() == ("", "")
    optimize_banded_toeplitz.cache_clear()
    loud = optimise(show_progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "optimising" in err and "it" in err
    assert loud == quiet


def test_default_progress_is_silent_off_a_terminal(capsys):
    optimize_blt(128, 2)
    assert capsys.readouterr() == ("", "")


def test_show_progress_is_validated():
    with pytest.raises(ParameterTypeError, match="show_progress"):
        optimize_blt(16, 2, show_progress="yes")


def test_the_same_settings_are_optimised_once(monkeypatch):
    calls = []
    minimize = opt.optimize.minimize
    monkeypatch.setattr(opt.optimize, "minimize",
                        lambda *a, **k: calls.append(1) or minimize(*a, **k))
    a = optimize_banded_toeplitz(200, 5, MinSeparation(20))
    n = len(calls)
    assert n >= 1
    # the same public settings, however spelled: reused, not recomputed
    assert optimize_banded_toeplitz(200, 5, MinSeparation(20), PrefixSum()) is a
    assert len(calls) == n
    # another setting is another optimisation, and a cleared memo recomputes the same
    optimize_banded_toeplitz(200, 5, MinSeparation(20), MomentumPrefixSum(0.5))
    assert len(calls) > n
    optimize_banded_toeplitz.cache_clear()
    assert optimize_banded_toeplitz(200, 5, MinSeparation(20)) == a
    b = optimize_blt(200, 2)
    assert optimize_blt(200, 2, SingleParticipation()) is b


def test_a_workload_privlearn_does_not_define_is_not_reused():
    class Mutable(Workload):
        def __init__(self):
            self.scale = 1.0

        def coefs(self, n):
            return np.full(n, self.scale)

    w = Mutable()
    a = optimize_banded_toeplitz(64, 4, None, w)
    w.scale = 2.0  # mutated: a memo keyed on the object would hand back a stale result
    assert optimize_banded_toeplitz(64, 4, None, w) is not a


def test_bands_past_the_separation_are_zero_and_said_so():
    """With participations ``sep`` apart, the optimum over the strategies whose
    sensitivity is exact past ``sep`` (non-negative, non-increasing) has zero bands past
    ``sep``: the loss is that of the ``sep``-banded optimum, and a warning says so."""
    n, sep = 96, 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        few = optimize_banded_toeplitz(n, sep, MinSeparation(sep))  # no warning
    with pytest.warns(StrategyAdjustedWarning, match=r"bands=12: the optimised strategy "
                      r"uses 6 bands.*at least 6 steps apart"):
        many = optimize_banded_toeplitz(n, 2 * sep, MinSeparation(sep))
    assert many.bands == 2 * sep and not np.any(many.coefs[sep:])
    assert loss(many, n, MinSeparation(sep)) == pytest.approx(
        loss(few, n, MinSeparation(sep)), rel=1e-6)
