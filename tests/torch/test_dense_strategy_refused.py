"""The PyTorch engine does not run a DenseStrategy: it is refused with a typed error when
the run is configured, before any noise is drawn (its noise keeps every past draw and is
fixed to its steps; the engine's noise and checkpoints run the Toeplitz recurrences)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from privlearn.correlated import DenseStrategy, optimize_dense  # noqa: E402
from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import make_private  # noqa: E402
from privlearn.torch.config import DPConfig  # noqa: E402
from privlearn.torch.correlated_noise import CorrelatedNoise  # noqa: E402


def test_config_refuses_a_dense_strategy():
    with pytest.raises(ConfigurationError, match="does not run a DenseStrategy"):
        DPConfig(noise_multiplier=1.0, epochs=1, noise=DenseStrategy(np.eye(4)))


def test_make_private_refuses_a_dense_strategy():
    model = nn.Linear(3, 1)
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    with pytest.raises(ConfigurationError, match="does not run a DenseStrategy"):
        make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(data, batch_size=4),
            noise_multiplier=1.0,
            epochs=1,
            noise=optimize_dense(4, show_progress=False),
        )


def test_torch_noise_refuses_a_dense_recurrence():
    with pytest.raises(ConfigurationError, match="Toeplitz recurrences only"):
        CorrelatedNoise(DenseStrategy(np.eye(3)).recurrence())
