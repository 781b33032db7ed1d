"""Surrogate steps for the RDP accountant's certified guesses of the PLD accountant
(private helper of :mod:`privlearn.accounting.pld`, see :func:`._pld_steps.rdp_guess`): a Poisson
replace-one step, which the RDP accountant does not account, as fixed-size sampling or
through its add/remove curve."""

from __future__ import annotations

from privlearn.accounting.mechanisms import Mechanism, Neighbouring, Sampling, Subsampled
from privlearn.accounting.registry import doubles_on_replace_one, relation_base
from privlearn.accounting.registry import pure_epsilon as registry_pure_epsilon

__all__ = ["_as_fixed_size", "_via_add_remove"]


def _poisson_replace_one(m: Mechanism) -> bool:
    return (
        isinstance(m, Subsampled)
        and m.scheme is Sampling.POISSON
        and m.neighbouring is Neighbouring.REPLACE_ONE
        and m.rate < 1.0
    )


def _as_fixed_size(m: Mechanism) -> Mechanism | None:
    """A Poisson replace-one step as fixed-size sampling (see :func:`._pld_steps.rdp_guess`)."""
    if not _poisson_replace_one(m):
        return None
    return Subsampled(m.base, m.rate, Sampling.FIXED, Neighbouring.REPLACE_ONE)


def _via_add_remove(m: Mechanism) -> Mechanism | None:
    """A Poisson replace-one step of a kind whose noise is relative to the add/remove
    bound (``replace_one_doubles_sensitivity``) as the RDP curve

        eps_RO(alpha) <= (alpha - 1/2) / (alpha - 1) eps_AR(2 alpha) + eps_AR(2 alpha - 1)

    from its add/remove curve ``eps_AR``: the dataset with the record and the one with
    its replacement are each an add/remove neighbour of the dataset with neither, and the
    Renyi divergence obeys the weak triangle inequality ``D_a(P||R) <= (a - 1/p) / (a - 1)
    D_{pa}(P||Q) + D_{(qa - 1)/(q - 1)}(Q||R)`` (Mironov 2017, Renyi Differential Privacy,
    Proposition 11, with p = q = 2). None for any other step (a kind stating its own
    epsilon states nothing about add/remove)."""
    if not (_poisson_replace_one(m) and doubles_on_replace_one(m.base)):
        return None
    from privlearn.accounting.mechanisms import RDPMechanism
    from privlearn.accounting.rdp import rdp_epsilon

    add_remove = Subsampled(m.base, m.rate, Sampling.POISSON, Neighbouring.ADD_REMOVE)
    # capped by the base at twice the sensitivity (both outputs are mixtures with the
    # same weights: joint quasi-convexity, van Erven & Harremoes 2014, Theorem 13)
    whole = relation_base(m, accountant="pld")

    def curve(alpha: float) -> float:
        via = (alpha - 0.5) / (alpha - 1.0) * float(rdp_epsilon(add_remove, 2.0 * alpha)) + float(
            rdp_epsilon(add_remove, 2.0 * alpha - 1.0)
        )
        return min(via, float(rdp_epsilon(whole, alpha)))

    return RDPMechanism(
        curve, name="replace-one through add/remove", pure_epsilon=registry_pure_epsilon(m)
    )
