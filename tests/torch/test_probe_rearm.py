"""What re-runs the batch-independence probe besides new call signatures: a module
attribute set after ``make_private`` (``model.mix = True`` switching on a path that mixes
examples) and a 0-d tensor flag argument (``model(x, mix=torch.tensor(True))``); both
trained unchecked, since only a new call signature re-armed the probe and a tensor
argument counted by its type. Attributes a forward sets itself (a call counter) are the
model's state, not a switch: they do not re-run it."""

from __future__ import annotations

import enum
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from toys import regression_engine, regression_step  # noqa: E402

from privlearn.torch import BatchDependenceError, _rearm  # noqa: E402
from privlearn.torch._tracker_util import NUMERIC_CALLS  # noqa: E402


class Norm(enum.Enum):
    NONE = "none"
    BATCH = "batch"


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.mix = False
        self.norm = Norm.NONE
        self.how = "plain"

    def forward(self, x):
        h = self.lin(x)
        if self.mix or self.how == "centred" or self.norm is Norm.BATCH:
            h = h - h.mean(0)  # mixes examples
        return h


class Switched(nn.Module):
    """Per example unless an attribute or the ``mix`` argument selects centring by the
    batch mean; counts its calls (``self.calls += 1``: state a forward sets itself)."""

    def __init__(self):
        super().__init__()
        self.block = _Block()
        self.head = nn.Linear(4, 1)
        self.calls = 0
        self.scale = 1.0

    def forward(self, x, mix=None):
        self.calls += 1
        h = self.block(x) * self.scale
        if getattr(self, "late", False):
            h = h - h.mean(0)
        if mix is not None:
            h = torch.where(mix, h - h.mean(0), h)
        return self.head(h)


def _private():
    torch.manual_seed(0)
    m = Switched()
    return regression_engine(m), m


@pytest.mark.parametrize(
    "where, name, value",
    [
        ("block", "mix", True),
        ("block", "how", "centred"),
        ("block", "norm", Norm.BATCH),
        ("model", "late", True),  # not an attribute at make_private
    ],
)
def test_an_attribute_switching_on_a_mixing_path_later_is_refused(where, name, value):
    p, m = _private()
    regression_step(p)
    regression_step(p)
    setattr(m.block if where == "block" else m, name, value)
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        regression_step(p)


def test_an_attribute_switched_before_a_forward_without_gradients_is_still_seen():
    """An evaluation forward between the switch and the next step does not hide it."""
    p, m = _private()
    regression_step(p)
    m.block.mix = True
    with torch.no_grad():
        p.model(torch.randn(4, 3))
    m.eval()
    p.model(torch.randn(4, 3))
    m.train()
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        regression_step(p)


def test_a_call_counter_does_not_rerun_the_probe():
    """The probe runs once (the step's forward and its three passes), then one forward
    a step, although ``calls`` changes at every forward."""
    p, m = _private()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            regression_step(p)
    assert m.calls == 1 + 3 + 3


def test_a_flag_set_back_to_a_value_already_probed_does_not_rerun_it():
    p, m = _private()
    regression_step(p)
    m.scale = 2.0
    regression_step(p)  # probed again: 1 + 3
    m.scale = 1.0
    regression_step(p)
    assert m.calls == (1 + 3) * 2 + 1


def test_a_number_set_at_every_step_warns_once_and_keeps_training():
    p, m = _private()
    steps = _rearm.ATTRIBUTE_NUMBERS + 4
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(steps):
            m.scale = 1.0 + i / 10
            regression_step(p)
    said = [w for w in seen if "numeric values between forwards" in str(w.message)]
    assert len(said) == 1 and "'scale'" in str(said[0].message)
    assert p.accountant.steps == steps
    # probed on its first values, and once more when it starts counting by its type
    assert m.calls == steps + 3 * (_rearm.ATTRIBUTE_NUMBERS + 1)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_zero_dim_tensor_flag_switching_on_a_mixing_path_is_refused(in_place):
    p, m = _private()
    flag = torch.tensor(False)
    regression_step(p, mix=flag)
    regression_step(p, mix=flag if in_place else torch.tensor(False))
    if in_place:
        flag.fill_(True)
    with pytest.raises(BatchDependenceError, match="examples are mixed"):
        regression_step(p, mix=flag if in_place else torch.tensor(True))


def test_an_unchanged_zero_dim_tensor_flag_does_not_rerun_the_probe():
    p, m = _private()
    for _ in range(3):
        regression_step(p, mix=torch.tensor(False))
    assert m.calls == 1 + 3 + 2


class _Reads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.__bool__):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_a_zero_dim_tensor_off_the_cpu_is_not_read_and_counted_by_identity():
    """Off the CPU a value read would wait for the device: a 0-d tensor argument re-arms
    the probe when it is another tensor, or modified in place, for the first
    NUMERIC_CALLS changes, then a warning says it no longer does."""
    flags = _rearm._DeviceFlags()
    t = torch.zeros((), device="meta")
    reads = _Reads()
    with reads:
        assert _rearm._read_flags((t,), {"mix": t}) == ((t,), {"mix": t})
        assert flags.changed((), {"mix": t})
        assert not flags.changed((), {"mix": t})
        t.add_(1)  # in place: its version moves
        assert flags.changed((), {"mix": t})
        assert not flags.changed((), {"mix": t})
    assert reads.reads == 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rearmed = [
            flags.changed((), {"mix": torch.zeros((), device="meta")}) for _ in range(NUMERIC_CALLS)
        ]
    assert sum(rearmed) == NUMERIC_CALLS - 2
    assert len([w for w in seen if "0-d tensor" in str(w.message)]) == 1


def test_a_zero_dim_tensor_on_the_cpu_counts_by_its_value():
    args, kwargs = _rearm._read_flags((torch.tensor(2),), {"mix": torch.tensor(True)})
    assert args == (2,) and kwargs == {"mix": True} and type(kwargs["mix"]) is bool


def test_a_combination_left_pending_and_replaced_before_the_probe_ran_is_not_taken_as_seen():
    """The probe runs at the step; a step that does not run it (a batch too small to
    compare examples) leaves it pending, and the forward after may bring other values:
    the combination of the first was never probed, so it re-arms the probe when it
    comes back."""
    m, shape = Switched(), object()
    a = _rearm._Attributes()
    assert a.changed(m, shape, probed=True)  # the first forward: pending from now
    m.block.mix = True
    assert a.changed(m, shape, probed=False)  # the probe did not run in between
    m.block.mix = False
    a.changed(m, shape, probed=False)  # the probe runs after this one, on mix=False
    m.block.mix = True
    assert a.changed(m, shape, probed=True)  # mix=True was never probed
    assert not a.changed(m, shape, probed=False)  # (unchanged since: pending already)
    m.block.mix = False
    assert not a.changed(m, shape, probed=True)  # mix=False was
