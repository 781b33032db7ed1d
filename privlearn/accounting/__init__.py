"""Privacy accounting: mechanisms, transformers, accountants and calibration.

Pure NumPy/SciPy; never imports torch or the models.

A new kind of mechanism is one frozen dataclass (a :class:`Mechanism` subclass) plus one
:func:`register_mechanism` call (see :mod:`privlearn.accounting.registry`); accountants are
added with :func:`register_accountant`.

>>> from privlearn.accounting import Gaussian, compose, subsample
>>> m = compose(subsample(Gaussian(noise_multiplier=1.1), rate=256 / 60000), steps=14040)
>>> eps = m.epsilon(delta=1e-5)            # certified upper bound, PLD accountant
"""

import sys

from privlearn._opacus_names import missing_name
from privlearn.accounting import _builtin_kinds  # noqa: F401  (registers the built-in kinds)
from privlearn.accounting.accountants import (
    PrivacyBound,
    available_accountants,
    get_accountant,
    register_accountant,
)
from privlearn.accounting.calibration import calibrate
from privlearn.accounting.discrete_laplace import DiscreteLaplace
from privlearn.accounting.matrix_mechanism import MatrixMechanism
from privlearn.accounting.mechanisms import (
    ApproxDP,
    Composed,
    Gaussian,
    Laplace,
    Mechanism,
    Neighbouring,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    Sampling,
    Subsampled,
    compose,
    subsample,
)
from privlearn.accounting.montecarlo import (
    BallsInBinsMatrixMechanism,
    EpsilonEstimate,
    estimate_epsilon,
)
from privlearn.accounting.planning import planned_steps, steps_per_epoch, warn_if_delta_large
from privlearn.accounting.registry import (
    MechanismKind,
    as_replace_one,
    register_mechanism,
    register_representation,
)
from privlearn.accounting.repeat_select import RepeatAndSelect
from privlearn.accounting.zcdp import ZCDP
from privlearn.errors import (
    AccountingError,
    CalibrationError,
    CertificationError,
    PrivacyLossOverflowError,
    UnsupportedMechanismError,
)

__all__ = [
    "AccountingError",
    "ApproxDP",
    "BallsInBinsMatrixMechanism",
    "CalibrationError",
    "CertificationError",
    "Composed",
    "DiscreteLaplace",
    "EpsilonEstimate",
    "Gaussian",
    "Laplace",
    "MatrixMechanism",
    "Mechanism",
    "MechanismKind",
    "Neighbouring",
    "PrivacyBound",
    "PrivacyLossOverflowError",
    "PureDP",
    "RDPMechanism",
    "RandomizedResponse",
    "RepeatAndSelect",
    "Sampling",
    "Subsampled",
    "UnsupportedMechanismError",
    "ZCDP",
    "as_replace_one",
    "available_accountants",
    "calibrate",
    "compose",
    "estimate_epsilon",
    "get_accountant",
    "planned_steps",
    "register_accountant",
    "register_mechanism",
    "register_representation",
    "steps_per_epoch",
    "subsample",
    "warn_if_delta_large",
]


def __getattr__(name: str):
    # only for names not defined above: Opacus's (get_noise_multiplier, RDPAccountant,
    # ...) say what to use
    raise missing_name(__name__, name, sys._getframe(1))
