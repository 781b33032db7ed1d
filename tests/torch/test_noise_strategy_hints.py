"""The declared type of the ``noise`` setting (DPConfig, the Hugging Face
PrivacyArguments, the run's NoisePlan) names every kind of strategy the engine runs:
the Toeplitz ones (banded, BLT) and the dense one."""

from __future__ import annotations

import typing

import numpy as np
import pytest

pytest.importorskip("torch")

from privlearn.correlated import BandedToeplitz, BufferedToeplitz, DenseStrategy  # noqa: E402
from privlearn.torch.config import DPConfig  # noqa: E402
from privlearn.torch.schedule import NoisePlan  # noqa: E402

STRATEGIES = (
    BandedToeplitz.square_root(bands=3),
    BufferedToeplitz(buf_decay=(0.9,), output_scale=(0.2,)),
    DenseStrategy(np.tril(np.ones((4, 4)))),
)


def _declared(cls: type, name: str):
    return typing.get_type_hints(cls)[name]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_every_accepted_strategy_is_in_the_declared_noise_type(strategy):
    from privlearn.torch._hf_args import PrivacyArguments

    for cls, name in ((PrivacyArguments, "noise"), (DPConfig, "noise"), (NoisePlan, "strategy")):
        assert isinstance(strategy, _declared(cls, name)), (cls.__name__, name)
    # and the engine's settings do accept it (the hint describes what runs)
    cfg = DPConfig(noise_multiplier=1.0, noise=strategy, steps=4, sampling="shuffled_epochs")
    assert cfg.noise is strategy
    args = PrivacyArguments(noise_multiplier=1.0, noise=strategy, sampling="shuffled_epochs")
    assert args.noise is strategy
