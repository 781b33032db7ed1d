"""The five models of the PyTorch DP-SGD benchmark, and synthetic data of realistic shape.

Each builder takes ``opacus_layers``: when True, the layers Opacus cannot differentiate per
sample (``nn.LSTM``, ``nn.MultiheadAttention``) are replaced by Opacus's drop-in
``DPLSTM`` / ``DPMultiheadAttention``, which is what an Opacus user must do. privlearn runs
the plain ``torch.nn`` modules. The two variants have the same parameter count and compute
the same function (``DPMultiheadAttention`` splits ``in_proj_weight`` into three
``nn.Linear``; ``DPLSTM`` unrolls the same cell equations).

Shapes: images are MNIST-shaped (1x28x28, or 784-vectors for the linear models); text is
token ids from a vocabulary of ``VOCAB`` words, sequences of ``SEQ_LEN`` tokens, 2 classes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from privlearn.torch.models import mnist_cnn

VOCAB = 10_000
SEQ_LEN = 64
EMBED_DIM = 64


class LogisticRegression(nn.Module):
    """Multinomial logistic regression on 784 pixels: one ``Linear(784, 10)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class MLP(nn.Module):
    """784-256-10 perceptron with a ReLU hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Pre-LayerNorm transformer encoder block: ``x + MHA(LN(x))``, then ``x + FF(LN(x))``."""

    def __init__(self, dim: int, heads: int, ff_dim: int, attention_cls: type) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = attention_cls(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, ff_dim)
        self.ff2 = nn.Linear(ff_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff2(torch.relu(self.ff1(self.ln2(x))))


class TransformerClassifier(nn.Module):
    """Token + position embeddings, two encoder blocks (4 heads), mean pooling, linear head."""

    def __init__(self, attention_cls: type, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBED_DIM)
        self.pos = nn.Embedding(SEQ_LEN, EMBED_DIM)
        self.blocks = nn.Sequential(
            *[EncoderBlock(EMBED_DIM, 4, 2 * EMBED_DIM, attention_cls) for _ in range(layers)]
        )
        self.ln = nn.LayerNorm(EMBED_DIM)
        self.head = nn.Linear(EMBED_DIM, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(n, t)
        x = self.blocks(self.tok(tokens) + self.pos(positions))
        return self.head(self.ln(x).mean(dim=1))


class LSTMClassifier(nn.Module):
    """Embedding(10k, 64) -> one-layer LSTM(64, 128) -> linear head on the last hidden state."""

    def __init__(self, lstm_cls: type, hidden: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBED_DIM)
        self.lstm = lstm_cls(EMBED_DIM, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(self.tok(tokens))
        return self.head(h[-1])


def build_model(name: str, opacus_layers: bool = False) -> nn.Module:
    """Model ``name`` (one of ``MODELS``), with Opacus's DP layers if ``opacus_layers``."""
    if name == "logreg":
        return LogisticRegression()
    if name == "mlp":
        return MLP()
    if name == "cnn":
        return mnist_cnn()
    if name == "transformer":
        if opacus_layers:
            from opacus.layers import DPMultiheadAttention

            return TransformerClassifier(DPMultiheadAttention)
        return TransformerClassifier(nn.MultiheadAttention)
    if name == "lstm":
        if opacus_layers:
            from opacus.layers import DPLSTM

            return LSTMClassifier(DPLSTM)
        return LSTMClassifier(nn.LSTM)
    raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")


def synthetic_data(name: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random examples shaped like the model's real inputs, with random labels."""
    g = torch.Generator().manual_seed(seed)
    if name in ("logreg", "mlp"):
        return torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)
    if name == "cnn":
        return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    if name in ("transformer", "lstm"):
        x = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)
        return x, torch.randint(0, 2, (n,), generator=g)
    raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")


MODELS: dict[str, Callable[..., nn.Module]] = {
    "logreg": LogisticRegression,
    "mlp": MLP,
    "cnn": mnist_cnn,
    "transformer": TransformerClassifier,
    "lstm": LSTMClassifier,
}
