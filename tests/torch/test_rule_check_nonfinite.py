"""A class-name rule is checked against the generic rule on its first call; a first call
whose values are not finite decides nothing (a NaN difference compares as agreeing, and
a look-alike layer's wrong rule would then be trusted for the rest of the run)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from privlearn.torch import grad_sample  # noqa: E402
from privlearn.torch.tracker import GradSampleTracker  # noqa: E402


class OddScaledWordEmbedding(nn.Embedding):
    """Named like Hugging Face's scaled word embeddings, with an ``embed_scale``, but
    squaring its rows: the class-name rule (rows times the scale) does not describe it."""

    embed_scale = 2.0

    def forward(self, ids):
        return super().forward(ids) ** 2 + self.embed_scale


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        OddScaledWordEmbedding(12, 4, dtype=torch.float64),
        nn.Flatten(),
        nn.Linear(12, 3, dtype=torch.float64),
    )


def _naive(model, ids, y, c):
    """The loop of batch-size-1 passes: each example's gradient clipped to ``c``, summed."""
    params = list(model.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(ids.shape[0]):
        loss = nn.functional.cross_entropy(model(ids[i : i + 1]), y[i : i + 1])
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
        total += g * min(1.0, c / float(g.norm()))
    return total


def test_a_non_finite_first_call_leaves_the_look_alike_rule_unchecked_not_trusted():
    model = _model()
    assert grad_sample.get_rule(model[0]).compute.__name__ == "scaled_embedding_rule"
    ids = torch.tensor([[1, 2, 3], [4, 4, 1], [0, 5, 9], [7, 7, 7]])
    y = torch.tensor([0, 1, 2, 1])
    c = 0.05
    tracker = GradSampleTracker(model, loss_reduction="mean")
    try:
        # a first step whose gradients are NaN (a diverged loss): whatever it does with
        # them, it must not settle that the class-name rule describes this layer
        nn.functional.cross_entropy(model(ids) * float("nan"), y).backward()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tracker.clipped_sum(c)
        except Exception:  # noqa: BLE001  (a refusal of the NaN step is fine here)
            pass
        tracker.clear()
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(ids), y).backward()
        with pytest.warns(RuntimeWarning, match="does not behave as privlearn's rule"):
            sums, _, _ = tracker.clipped_sum(c)
    finally:
        tracker.detach()
    got = torch.cat([sums[id(p)].reshape(-1) for p in model.parameters()])
    ref = _naive(model, ids, y, c)
    assert (got - ref).norm() <= 1e-10 * ref.norm()
