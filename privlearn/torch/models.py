"""Reference models used by the examples and benchmarks."""

from __future__ import annotations

from torch import nn

__all__ = ["mnist_cnn"]


def mnist_cnn() -> nn.Sequential:
    """The small tanh CNN of Tramer & Boneh (2021), also Opacus's MNIST example (26,010
    parameters), for 1x28x28 inputs and 10 classes.

    References
    ----------
    F. Tramer and D. Boneh, "Differentially Private Learning Needs Better Features (or Much
    More Data)", ICLR 2021, Table 8 (end-to-end CNN for MNIST).
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.Tanh(),
        nn.Linear(32, 10),
    )
