"""dp_accounting's ``SingleEpochTreeAggregationDpEvent`` (tree aggregation restarted every
epoch, each record in one leaf; Kairouz et al. 2021, Appendix D) is, in privlearn,
:class:`~privlearn.accounting.MatrixMechanism` of sensitivity ``sqrt(depth)``: a record
enters ``depth = ceil(log2(steps + 1))`` nodes of the tree, each with independent Gaussian
noise, so zeroing it out (dp_accounting's ``REPLACE_SPECIAL``; the same sums as removing
it) moves the released vector by at most ``sqrt(depth)`` clipping bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting import MatrixMechanism, compose

dp_event = pytest.importorskip("dp_accounting.dp_event")
dpa = pytest.importorskip("dp_accounting")
rdp_acc = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")


@pytest.mark.parametrize(
    "sigma,step_counts,epochs", [(1.0, [100], 3), (3.0, [7, 64, 1000], 1), (0.7, [1], 20)]
)
def test_tree_aggregation_is_a_matrix_mechanism(sigma, step_counts, epochs) -> None:
    acc = rdp_acc.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL)
    acc.compose(dp_event.SingleEpochTreeAggregationDpEvent(sigma, step_counts), epochs)
    depth = math.ceil(math.log2(max(step_counts) + 1))
    ours = compose(MatrixMechanism(sigma, math.sqrt(depth)), steps=epochs)
    orders = np.array([1.5, 2.0, 8.0, 32.0])
    theirs = np.array(acc._rdp)[[list(acc._orders).index(a) for a in orders]]
    got = np.asarray(ours.rdp(orders))
    assert np.all(got >= theirs * (1 - 1e-12)) and np.allclose(got, theirs, rtol=1e-9)
    for delta in (1e-5, 1e-9):
        assert ours.epsilon(delta, "rdp") <= acc.get_epsilon(delta) * (1 + 1e-9)
        # the exact (PLD/analytic) answer: no larger than the RDP conversion
        assert ours.epsilon(delta) <= ours.epsilon(delta, "rdp") * (1 + 1e-9)
