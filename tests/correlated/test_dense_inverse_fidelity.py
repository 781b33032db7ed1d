"""The noise of a DenseStrategy is ``A z`` with ``A`` the *computed* ``C^{-1}`` (float64,
or rounded to float32 by the PyTorch engine): the release is the Gaussian mechanism of the
strategy ``A^{-1}``, post-processed. Its accounted sensitivity must bound that of
``A^{-1}`` -- computed here in 80-digit arithmetic from the very floats the noise
applies -- or the strategy must be refused before any noise is drawn."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest

from privlearn.correlated import (
    DenseStrategy,
    FixedEpochs,
    SingleParticipation,
    optimize_dense,
)
from privlearn.correlated.accounting import correlated_mechanism
from privlearn.correlated.noise import CorrelatedNoise
from privlearn.errors import ParameterValueError


def _column_sensitivity_of_inverse(a: np.ndarray) -> float:
    """Largest column norm (single participation) of ``a^{-1}``, exactly enough."""
    with mpmath.workdps(80):
        inv = mpmath.matrix(a.tolist()) ** -1
        n = a.shape[0]
        return float(max(mpmath.sqrt(sum(inv[i, j] ** 2 for i in range(n))) for j in range(n)))


def _ill_conditioned(rng: np.random.Generator, n: int, smallest: float) -> np.ndarray:
    c = np.tril(rng.standard_normal((n, n)))
    np.fill_diagonal(c, 10.0 ** rng.uniform(smallest, 0, n))
    return c


def test_accounting_covers_the_noise_of_the_computed_inverse():
    rng = np.random.default_rng(1)
    accounted = refused = 0
    for smallest in np.linspace(-0.5, -6.0, 12):
        n = int(rng.integers(4, 11))
        strategy = DenseStrategy(_ill_conditioned(rng, n, smallest))
        try:
            m = correlated_mechanism(strategy, SingleParticipation(), 1.0, steps=n)
        except ParameterValueError as e:
            assert "ill-conditioned" in str(e)
            refused += 1
            continue
        accounted += 1
        a = strategy.recurrence().inverse  # what the NumPy and float64 torch noise apply
        single = a.astype(np.float32).astype(np.float64)  # the float32 torch noise
        for used in (a, single):
            assert m.sensitivity >= _column_sensitivity_of_inverse(used)
    assert accounted and refused  # both sides of the line are exercised


def test_an_ill_conditioned_matrix_is_refused_before_any_noise():
    c = _ill_conditioned(np.random.default_rng(1), 5, -6.0)
    strategy = DenseStrategy(c)
    # the float32 noise is that of a strategy ~1800 times as sensitive as C
    a = strategy.inverse().astype(np.float32).astype(np.float64)
    assert _column_sensitivity_of_inverse(a) > 100 * np.linalg.norm(c, axis=0).max()
    with pytest.raises(ParameterValueError, match="ill-conditioned"):
        strategy.recurrence()
    with pytest.raises(ParameterValueError, match="ill-conditioned"):
        correlated_mechanism(strategy, SingleParticipation(), 1.0, steps=3)
    with pytest.raises(ParameterValueError, match="ill-conditioned"):
        CorrelatedNoise(strategy.recurrence(), (2,))
    torch = pytest.importorskip("torch")
    from privlearn.torch import make_private

    model = torch.nn.Linear(2, 1)
    data = torch.utils.data.TensorDataset(torch.zeros(10, 2), torch.zeros(10, 1))
    with pytest.raises(ParameterValueError, match="ill-conditioned"):
        make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.utils.data.DataLoader(data, batch_size=2),
            noise=strategy,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sampling="shuffled_epochs",
            steps=5,
            seed=0,
        )


@pytest.mark.parametrize("part", [SingleParticipation(), FixedEpochs(2)])
def test_an_optimised_strategy_costs_at_most_a_float32_rounding(part):
    n = 10
    strategy = optimize_dense(n, part, show_progress=False)
    m = correlated_mechanism(strategy, part, 1.0, steps=n)
    # optimize_dense scales its C to sensitivity 1 under these schemas
    assert 1.0 <= m.sensitivity <= 1.0 + 1e-5
    if isinstance(part, SingleParticipation):
        a = strategy.inverse()
        for used in (a, a.astype(np.float32).astype(np.float64)):
            assert m.sensitivity >= _column_sensitivity_of_inverse(used)


def test_a_pickled_or_copied_strategy_is_validated_and_read_only():
    import copy
    import pickle

    strategy = DenseStrategy(np.tril(np.ones((3, 3))))
    strategy.noise_factor()  # cached on the instance
    for other in (pickle.loads(pickle.dumps(strategy)), copy.deepcopy(strategy)):
        assert other == strategy and repr(other) == repr(strategy)
        assert not other.matrix.flags.writeable  # as the constructor leaves it
        with pytest.raises(ValueError):
            other.matrix[0, 0] = 2.0
    # a stored matrix that is not a strategy is refused when it is read back
    bad = pickle.dumps(strategy).replace(
        np.array(1.0).tobytes(), np.array(float("nan")).tobytes(), 1
    )
    with pytest.raises(ParameterValueError, match="finite"):
        pickle.loads(bad)


def test_equal_matrices_have_one_hash_and_one_name():
    a = DenseStrategy([[1.0, 0.0], [0.0, 1.0]])
    b = DenseStrategy([[1.0, -0.0], [-0.0, 1.0]])  # -0.0 == 0.0: the same strategy
    assert a == b
    assert hash(a) == hash(b) and len({a, b}) == 1
    assert repr(a) == repr(b)  # a checkpoint of one resumes under the other


def test_the_factor_covers_the_rounding_of_the_inner_products_that_apply_it():
    """The noise of step ``t`` is an inner product of ``t + 1`` terms computed in float32
    (the PyTorch engine), within ``gamma_{t+1} |A| |z|`` of ``A z`` (Higham 2002, Eq.
    (3.4)): the noise of ``A + D`` for some ``|D| <= gamma_n |A|``. The factor must cover
    the residual of every such ``A + D``; checked for the two extreme ``D = +-gamma_n |A|``
    (a residual of ~``n 2^-24 || |C| |A| ||``, far above the inverse's own ~``1e-7``),
    and the float32 noise is checked to stay within the bound."""
    from privlearn.correlated import BandedToeplitz

    torch = pytest.importorskip("torch")
    from privlearn.torch.correlated_noise import CorrelatedNoise as TorchNoise

    n = 64
    c = BandedToeplitz.square_root(8).materialize(n)
    strategy = DenseStrategy(c)
    a32 = strategy.inverse().astype(np.float32).astype(float)
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    worst = max(
        np.linalg.norm(c @ (a32 + sign * gamma * np.abs(a32)) - np.eye(n), 2)
        for sign in (1.0, -1.0)
    )
    assert worst > 1e-5  # the inner products' part: larger than the inverse's
    assert strategy.noise_factor() >= 1.0 / (1.0 - worst)
    # the float32 noise (elementwise axpy's over the draws so far) is within the bound
    z = np.random.default_rng(2).standard_normal((n, 3)).astype(np.float32)
    gen = TorchNoise(strategy.recurrence())
    got = np.array([gen.apply_(torch.tensor(row)).double().numpy() for row in z])
    want = a32 @ z.astype(float)
    assert np.all(np.abs(got - want) <= gamma * (np.abs(a32) @ np.abs(z.astype(float))))
