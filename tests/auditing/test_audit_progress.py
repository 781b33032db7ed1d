"""The audits' progress bars: standard error only, off unless asked or on a terminal,
and never a change in the result."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from privlearn.errors import ParameterTypeError


def _quiet_audit(fn, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # too few canaries to refute: known
        return fn(**kw)


def test_audit_dpsgd_shows_its_steps_on_stderr_only_when_asked(capsys):
    torch_audit = pytest.importorskip("privlearn.auditing.torch")
    kw = dict(epsilon=2.0, delta=1e-5, n_canaries=20, steps=4, n_data=100, seed=1)
    quiet = _quiet_audit(torch_audit.audit_dpsgd, **kw)
    assert capsys.readouterr() == ("", "")  # default: not a terminal here
    loud = _quiet_audit(torch_audit.audit_dpsgd, show_progress=True, **kw)
    out, err = capsys.readouterr()
    assert out == "" and "audit: training" in err and "/4" in err
    np.testing.assert_array_equal(loud.result.scores, quiet.result.scores)
    assert loud.result.epsilon_lower_bound == quiet.result.epsilon_lower_bound
    with pytest.raises(ParameterTypeError, match="show_progress"):
        torch_audit.audit_dpsgd(show_progress="yes", **kw)


@pytest.mark.slow
def test_audit_training_pieces_show_their_steps(capsys):
    torch = pytest.importorskip("torch")
    from privlearn.auditing.torch import audit_training

    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(60, 3, generator=g), torch.randint(0, 2, (60,), generator=g)
    kw = dict(make_model=lambda: torch.nn.Linear(3, 2), batch_size=10, epochs=1,
              private={"noise_multiplier": 1.0, "max_grad_norm": 1.0}, n_canaries=10,
              seed=0)
    quiet = _quiet_audit(audit_training, dataset=(X, y), **kw)
    assert capsys.readouterr() == ("", "")
    loud = _quiet_audit(audit_training, dataset=(X, y), show_progress=True, **kw)
    out, err = capsys.readouterr()
    assert out == "" and "audit: training" in err
    np.testing.assert_array_equal(loud.scores, quiet.scores)
