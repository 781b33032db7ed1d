"""Correlated noise across steps: matrix-factorization strategies (DP-FTRL, banded MF,
buffered linear Toeplitz, dense), their sensitivity, error and optimisation, and the samplers
that bound participation. :data:`SAMPLINGS` is the registry of every sampling privlearn
trains with (one :class:`SamplingLaw` each: the batch draw and the law its accountant
assumes).

NumPy/SciPy only; imports nothing from privlearn but the accounting and validation
layers. The accounting of each (strategy, sampler) combination is in
:mod:`privlearn.correlated.accounting`; see docs/guides/correlated-noise.md.
"""

from privlearn.correlated.dense import optimize_dense
from privlearn.correlated.error import (
    MomentumPrefixSum,
    PrefixSum,
    Workload,
    loss,
    per_query_error,
)
from privlearn.correlated.optimize import (
    StrategyOptimizationError,
    optimize_banded_toeplitz,
    optimize_blt,
)
from privlearn.correlated.participation import (
    FixedEpochs,
    MinSeparation,
    Participation,
    SingleParticipation,
)
from privlearn.correlated.sampling import SAMPLINGS, SamplingLaw, register_sampling
from privlearn.correlated.sensitivity import Sensitivity, dense_sensitivity, sensitivity
from privlearn.correlated.strategies import (
    BandedRecurrence,
    BandedToeplitz,
    BufferedRecurrence,
    BufferedToeplitz,
    DenseRecurrence,
    DenseStrategy,
    Identity,
    ToeplitzStrategy,
)

__all__ = [
    "BandedRecurrence",
    "BandedToeplitz",
    "BufferedRecurrence",
    "BufferedToeplitz",
    "DenseRecurrence",
    "DenseStrategy",
    "FixedEpochs",
    "Identity",
    "MinSeparation",
    "MomentumPrefixSum",
    "Participation",
    "PrefixSum",
    "SAMPLINGS",
    "SamplingLaw",
    "Sensitivity",
    "SingleParticipation",
    "StrategyOptimizationError",
    "ToeplitzStrategy",
    "Workload",
    "dense_sensitivity",
    "loss",
    "optimize_banded_toeplitz",
    "optimize_blt",
    "optimize_dense",
    "per_query_error",
    "register_sampling",
    "sensitivity",
]
