"""A composition of Poisson-subsampled (add/remove) and fixed-size-subsampled
(replace-one) parts is evaluated under replace-one, the one relation both hold under."""

from __future__ import annotations

import warnings

import pytest

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.errors import UnsupportedMechanismError


def _dp_accounting_replace_one_epsilon(sigma: float, q: float, steps: int, delta: float):
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = pld_privacy_accountant.PLDAccountant(
            neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE,
            value_discretization_interval=1e-3,
        )
        acc.compose(
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
        )
        return acc.get_epsilon(delta)


def test_poisson_part_next_to_a_fixed_size_part_costs_its_replace_one_price():
    # The fixed-size part (replace-one) is nearly free; the Poisson part then sets the
    # total, and under replace-one -- the only relation the fixed-size part holds under --
    # it costs what Google dp_accounting's REPLACE_ONE PLD says (0.895), not its add/remove
    # epsilon (0.718, which the mixed composition reported).
    sigma, q, steps, delta = 1.0, 0.01, 100, 1e-5
    mixed = compose(
        [subsample(Gaussian(sigma), q), subsample(Gaussian(100.0), 0.001, scheme="fixed")],
        steps=[steps, 1],
    )
    reference = _dp_accounting_replace_one_epsilon(sigma, q, steps, delta)
    assert mixed.epsilon(delta) >= reference * (1 - 1e-3)
    assert mixed.delta(0.9 * reference) >= compose(subsample(Gaussian(sigma), q), steps).delta(
        0.9 * reference
    )


def test_mixed_composition_under_rdp_is_a_typed_refusal_naming_the_reading():
    mixed = compose(
        [subsample(Gaussian(1.0), 0.01), subsample(Gaussian(1.0), 0.01, scheme="fixed")]
    )
    with pytest.raises(UnsupportedMechanismError, match="read under replace-one"):
        mixed.epsilon(1e-5, "rdp")


@pytest.mark.parametrize(
    "other",
    [
        subsample(Gaussian(1.0), 0.1, neighbouring="add_only"),
        subsample(Gaussian(1.0), 0.1, scheme="fixed"),
    ],
)
def test_remove_only_part_with_an_opposite_or_replace_one_part_is_refused(other):
    mixed = compose([subsample(Gaussian(1.0), 0.1, neighbouring="remove_only"), other])
    with pytest.raises(UnsupportedMechanismError, match="holds under no relation"):
        mixed.epsilon(1e-5)
    with pytest.raises(UnsupportedMechanismError, match="holds under no relation"):
        mixed.delta(1.0)


def test_add_remove_with_one_one_sided_relation_is_evaluated_as_before():
    g = Gaussian(1.0)
    m = compose([subsample(g, 0.1), subsample(g, 0.1, neighbouring="remove_only")])
    assert m.epsilon(1e-5) > 0
