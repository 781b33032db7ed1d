"""autodp-compatible facade backed by :mod:`privlearn.accounting`.

Code written for autodp (``autodp.autodp_core``, ``autodp.mechanism_zoo``,
``autodp.transformer_zoo``, ``autodp.calibrator_zoo``) runs after changing only its
import lines::

    from privlearn.compat.autodp.autodp_core import Mechanism
    from privlearn.compat.autodp import mechanism_zoo, transformer_zoo
    from privlearn.compat.autodp.calibrator_zoo import eps_delta_calibrator

``rdp_bank``, ``dp_bank``, ``fdp_bank``, ``dp_acct.DP_acct``, ``rdp_acct.anaRDPacct``,
autodp's legacy ``privacy_calibrator`` and ``utils`` are provided for the functions
users import most (each backed by privlearn's accountants); unported autodp
names raise an ``AttributeError`` saying so. autodp arguments that cannot change a value
here raise :class:`~privlearn.compat.autodp.autodp_core.AutodpArgumentWarning` when set
away from autodp's defaults.

Every epsilon is a certified upper bound from privlearn's accountants (exact for
compositions of Gaussians, PLD otherwise, RDP for user-supplied RDP functions); see
:mod:`privlearn.compat.autodp.autodp_core` for the differences from autodp.
"""

from privlearn.compat.autodp import (
    autodp_core,
    calibrator_zoo,
    dp_acct,
    dp_bank,
    fdp_bank,
    mechanism_zoo,
    privacy_calibrator,
    rdp_acct,
    rdp_bank,
    transformer_zoo,
    utils,
)

__all__ = [
    "autodp_core",
    "calibrator_zoo",
    "dp_acct",
    "dp_bank",
    "fdp_bank",
    "mechanism_zoo",
    "privacy_calibrator",
    "rdp_acct",
    "rdp_bank",
    "transformer_zoo",
    "utils",
]
