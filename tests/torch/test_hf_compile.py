"""torch.compile (default backend): a compiled model trains privately and gives the same
clipped gradients as eager."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from privlearn.torch.tracker import GradSampleTracker  # noqa: E402

#: One xdist work unit: the first compilation of a process with the default backend
#: (inductor) costs about 9 s, the next ones a fraction of a second; under ``-n`` the two
#: orders below would otherwise often run on two workers, each paying it.
pytestmark = pytest.mark.xdist_group("inductor")


def _sum(model, run, c):
    tracker = GradSampleTracker(model)
    try:
        run().backward()
        sums, _, norms = tracker.clipped_sum(c)
    finally:
        tracker.detach()
    return torch.cat([sums[id(p)].reshape(-1) for p in model.parameters()]), norms


@pytest.mark.parametrize("order", ["compile_then_track", "track_then_compile"])
def test_compiled_mlp_matches_eager(order, make_mlp):
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    eager = make_mlp(norm=True)
    ref, n = _sum(eager, lambda: nn.functional.cross_entropy(eager(x), y), 1.0)
    model = make_mlp(norm=True)
    compiled = torch.compile(model)
    if order == "compile_then_track":
        tracker = GradSampleTracker(compiled)
    else:
        tracker = GradSampleTracker(model)
        compiled = torch.compile(model)
    for _ in range(2):  # the second call runs the cached compiled graph
        nn.functional.cross_entropy(compiled(x), y).backward()
        sums, _, norms = tracker.clipped_sum(1.0)
        got = torch.cat([sums[id(p)].reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norms, n, rtol=1e-5, atol=1e-6)
    tracker.detach()


@pytest.mark.slow
def test_compiled_gpt2_matches_eager():
    pytest.importorskip("transformers")
    from hf_models import build, engine_sum, loss_of, make_batch

    model = build("gpt2", dtype=torch.float32)
    inputs, labels = make_batch("gpt2", dtype=torch.float32)
    ref, n, _ = engine_sum("gpt2", model, inputs, labels, 1.0)
    compiled = torch.compile(model)
    got, norms = _sum(model, lambda: loss_of("gpt2", compiled(**inputs), labels), 1.0)
    torch.testing.assert_close(norms.double(), n, rtol=1e-4, atol=1e-6)
    assert (got.double() - ref).norm() <= 1e-4 * ref.norm()
