"""A TorchScript module in the model (``torch.jit.script``, ``trace`` or ``load``) is
refused by make_private with an UnsupportedModuleError naming it; the validator read its
``_parameters`` (a TorchScript wrapper without ``.get``) and make_private failed with a
bare AttributeError."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.errors import UnsupportedModuleError  # noqa: E402
from privlearn.torch import make_private, validate  # noqa: E402


def _scripted_first():
    torch.manual_seed(0)
    return nn.Sequential(torch.jit.script(nn.Linear(6, 8)), nn.ReLU(), nn.Linear(8, 3))


def _traced_whole():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return torch.jit.trace(eager, torch.randn(4, 6))


def _frozen_backbone():
    torch.manual_seed(0)
    backbone = torch.jit.script(nn.Sequential(nn.Linear(6, 8), nn.Tanh()))
    for q in backbone.parameters():  # (ScriptModule has no requires_grad_)
        q.requires_grad_(False)
    return nn.Sequential(backbone, nn.Linear(8, 3))


@pytest.mark.parametrize(
    "build, where",
    [(_scripted_first, "0"), (_traced_whole, "<model>"), (_frozen_backbone, "0")],
    ids=["scripted-layer", "traced-model", "frozen-scripted-backbone"],
)
def test_a_torchscript_module_is_refused_naming_it_before_anything(build, where):
    model = build()
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    before = [q.detach().clone() for q in model.parameters()]
    trainable = [q for q in model.parameters() if q.requires_grad]
    with pytest.raises(
        UnsupportedModuleError, match=rf"{where} \(.*\): a TorchScript module.*eager"
    ):
        make_private(
            model,
            torch.optim.SGD(trainable, lr=0.1),
            DataLoader(ds, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len(validate(model)) == 1
