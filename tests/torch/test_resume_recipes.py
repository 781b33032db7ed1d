"""Checkpoint recipes users bring from other DP-SGD libraries, against a fresh run of
make_private: what is refused says which call refused it and what to do instead."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from train_loops import train_steps  # noqa: E402

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402


def _run():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.arange(32) % 2)
    p = make_private(
        model,
        optimizer,
        DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        seed=0,
    )
    return model, optimizer, p


def test_an_opacus_style_optimizer_checkpoint_is_refused_naming_the_optimizer_called():
    """Opacus's examples save ``optimizer.state_dict()`` of the variable they keep (the
    optimizer given to make_private) and load it back into that variable: the refusal
    names that optimizer, not ``p.optimizer``, says the checkpoint cannot resume the run
    and what to save instead, and loads nothing."""
    model, optimizer, p = _run()
    train_steps(p, 3)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    model2, optimizer2, p2 = _run()
    before = optimizer2.state_dict()
    with pytest.raises(ConfigurationError) as caught:
        optimizer2.load_state_dict(saved["optimizer"])
    text = str(caught.value)
    assert text.startswith("load_state_dict of the optimizer given to make_private")
    assert "cannot resume a run: save p.state_dict() instead" in text
    assert "Nothing was loaded" in text
    assert optimizer2.state_dict() == before and p2.accountant.steps == 0
    with pytest.raises(ConfigurationError, match=r"^load_state_dict of p\.optimizer"):
        p2.optimizer.load_state_dict(saved["optimizer"])


def test_the_noise_source_cannot_be_swapped_for_a_rewound_one_once_the_run_has_steps():
    """Its ``load_state_dict`` refuses a saved state once the run has steps (the noise of
    released steps would be drawn again); a new source loaded with that state, put in
    its place, is refused the same way. Before the first step a new source may take its
    place, and then guards itself as the old one did."""
    from privlearn.torch.noise import NoiseSource

    _, _, p = _run()
    saved = p.state_dict()["noise"]
    fresh = NoiseSource()
    p.optimizer.noise = fresh  # before any step: allowed
    train_steps(p, 2)
    with pytest.raises(ConfigurationError, match="load_state_dict"):
        fresh.load_state_dict(saved)
    rewound = NoiseSource()
    rewound.load_state_dict(saved)
    with pytest.raises(ConfigurationError, match=r"p\.optimizer\.noise cannot be replaced"):
        p.optimizer.noise = rewound
    assert p.optimizer.noise is fresh
