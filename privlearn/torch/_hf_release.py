"""What :class:`~privlearn.torch.hf.DPTrainer` releases with a model, and what it refuses
before a run: the public privacy report written next to saved weights, the error for a
budget already spent, and the refusal of encoder-decoder models."""

from __future__ import annotations

from privlearn.errors import PrivacyBudgetExceededError

__all__ = ["spent_budget_error"]


def spent_budget_error(p, epsilon: float) -> PrivacyBudgetExceededError:
    """The error for a ``train()`` whose engine ``p`` has no room left for one step under
    its ``max_epsilon`` (an earlier ``train()`` of the same trainer spent it); raised
    before the run draws a batch."""
    b = p.budget
    return PrivacyBudgetExceededError(
        f"max_epsilon={b.max_epsilon:g} at delta={b.delta:g} is spent: this trainer already "
        f"took {p.accountant.steps} step(s) (epsilon {epsilon:.4g}), and one more step "
        f"(noise_multiplier={p.noise_multiplier:.4g}, sampling rate {p.sampling_rate:.4g}) "
        "would exceed it; no batch was drawn. Release the model trained so far (its epsilon "
        "is the one above), or, if a larger budget is acceptable, train in a new DPTrainer "
        "with a larger max_epsilon and count both runs' epsilon yourself")
