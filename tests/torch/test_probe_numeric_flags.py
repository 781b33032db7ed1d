"""A forward called with a numeric flag it was not called with before (``mode=1`` after
steps with ``mode=0``) re-runs the batch-independence probe, as a new bool or str flag
does: the path it selects may mix examples. A counter that changes every call stops
being told apart after a bounded number of signatures, with a warning."""

from __future__ import annotations

import enum
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from toys import regression_engine, regression_step  # noqa: E402

from privlearn.torch import BatchDependenceError  # noqa: E402
from privlearn.torch._tracker_util import NUMERIC_CALLS  # noqa: E402


class Mode(enum.Enum):
    PLAIN = 0
    CENTRED = 1


class Switched(nn.Module):
    """Per-example unless ``mode`` selects centring by the batch mean (mixes examples)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x, mode=0, step=0):
        mixing = mode in (1, 1.0, Mode.CENTRED)
        return self.lin(x - x.mean(0) if mixing else x)


def _private():
    torch.manual_seed(0)
    return regression_engine(Switched())


@pytest.mark.parametrize(
    "plain, mixing", [(0, 1), (0.0, 1.0), (Mode.PLAIN, Mode.CENTRED)], ids=["int", "float", "enum"]
)
def test_a_numeric_flag_selecting_a_mixing_path_later_is_refused(plain, mixing):
    p = _private()
    regression_step(p, mode=plain)
    regression_step(p, mode=plain)
    with pytest.raises(BatchDependenceError):
        regression_step(p, mode=mixing)


def test_a_step_counter_argument_warns_once_past_the_bound_and_keeps_training():
    p = _private()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(NUMERIC_CALLS + 4):
            regression_step(p, step=i)
    said = [w for w in seen if "distinct signatures" in str(w.message)]
    assert len(said) == 1
    assert p.accountant.steps == NUMERIC_CALLS + 4
