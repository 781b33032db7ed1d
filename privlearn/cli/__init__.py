"""Command line interface: a thin layer over :mod:`privlearn.accounting`, the ledger and
the audits.

Commands
--------
``privlearn epsilon``    certified epsilon of a (subsampled, composed) Gaussian/Laplace
``privlearn calibrate``  smallest noise multiplier meeting an (epsilon, delta) target
``privlearn demo``       accounting table of four DP learning algorithms, then a short
                         linear-regression experiment
``privlearn reproduce``  run one of the end-to-end experiments (CSV + PNG)
``privlearn budget``     a persistent privacy ledger (init, spend, show, history, verify)
``privlearn audit dpsgd`` empirical privacy audit of the DP-SGD engine (canaries)

Errors and exit statuses
------------------------
An error caused by the input or by the state of a ledger is reported as ONE line
``error: ...`` on stderr (with what to try, where there is a suggestion), never as a
traceback. The exit status is chosen by the *type* of the error (:data:`EXIT_STATUS`, a
table keyed by the classes of :mod:`privlearn.errors`, looked up along the MRO), never by
its message: see :class:`ExitStatus`. Any other exception is a bug and shows its
traceback (status 1).

One module per command group (:mod:`privlearn.cli.accounting`: ``epsilon``,
``calibrate``; :mod:`privlearn.cli.experiments`: ``demo``, ``reproduce``;
:mod:`privlearn.cli.budget`; :mod:`privlearn.cli.audit`), the options they share in
``_options``, the group and its error handling in ``_app`` (see docs/guides/cli.md).
"""

from __future__ import annotations

from privlearn.cli import accounting, audit, budget, experiments  # noqa: F401 (commands)
from privlearn.cli._app import EXIT_STATUS, HINTS, ExitStatus, cli, main
from privlearn.cli._options import build_mechanism

__all__ = ["cli", "main", "build_mechanism", "ExitStatus", "EXIT_STATUS", "HINTS"]
