"""A persistent privacy ledger: the whole project's budget, per dataset, across processes.

Every release made from a dataset -- a private scaler, model fits, a hyperparameter search,
a DP-SGD run, label releases -- is recorded as its *mechanism* (what ran, in the versioned
JSON form of :mod:`privlearn.accounting.serialization`), with the time, a label and who
spent it. The total spent is computed by composing the stored mechanisms with an
accountant (by default the PLD accountant's tight composition of heterogeneous releases,
with certified lower and upper bounds), not by adding epsilons.

>>> import os, tempfile
>>> from privlearn.accounting import Gaussian, compose, subsample
>>> from privlearn.ledger import Ledger
>>> ledger = Ledger(os.path.join(tempfile.mkdtemp(), "privacy.db"), create=True)
>>> _ = ledger.create_budget("mnist", epsilon=3.0, delta=1e-5)
>>> run = compose(subsample(Gaussian(1.1), rate=256 / 60000), steps=2000)
>>> with ledger.reserve("mnist", run, label="dp-sgd") as r:   # before touching the data
...     pass                                                     # train; settles on exit
>>> round(ledger.spent("mnist").epsilon_spent, 2) <= 3.0
True

Guarantees
----------
* **Atomic cap.** :meth:`Ledger.spend` and :meth:`Ledger.reserve` check and append in one
  ``BEGIN IMMEDIATE`` SQLite transaction: with any number of processes writing at once
  the admitted total never exceeds the cap and no spend is lost or duplicated. A refused
  spend raises :class:`~privlearn.errors.BudgetExceededError` and records nothing; call
  it before the release reads the data.
* **Durable.** WAL journal with ``synchronous=FULL``: a spend that returned survives a
  crash (``SIGKILL``, power loss) of the process.
* **Tamper-evident, and refused when tampered.** Entries are append-only (triggers refuse
  ``UPDATE``/``DELETE``) and hash-chained; a head record holds the count and last hash.
  Editing, deleting or truncating entries (with the triggers dropped) is reported by
  :meth:`Ledger.verify` (``privlearn budget verify``), and until the file verifies again
  every other method -- totals, history, spends, reservations -- raises
  :class:`~privlearn.errors.LedgerIntegrityError` instead of answering from it (a deleted
  spend must not give a total that is too low). Without a ``key`` anyone able to rewrite
  the whole file can recompute the chain; pass ``key=`` (HMAC) or store
  :meth:`Ledger.head` elsewhere (``verify(expected_head=...)``) to detect that too; a
  ``Ledger`` object also refuses a file rolled back behind a head it has verified.
* **No silent creation.** ``Ledger(path)`` opens an existing ledger and raises
  :class:`~privlearn.errors.LedgerNotFoundError` when there is none;
  ``Ledger(path, create=True)`` (or ``privlearn budget init``) creates it.
* **One privacy unit and one neighbouring relation per budget.** A budget is kept per
  dataset and privacy unit, and every spender checks the unit with
  :func:`check_privacy_unit` (a per-record release is refused by a per-user budget and the
  other way round). Its total holds under one neighbouring relation
  (:attr:`Spent.neighbouring`): the one given to :meth:`Ledger.create_budget`, else the
  one its first release fixes. A release with no guarantee under it (a replace-one one,
  e.g. fixed-size sampling, on an add/remove budget) is refused with
  :class:`~privlearn.errors.LedgerConflictError` and nothing recorded; an add/remove
  release on a replace-one budget is counted at its replace-one cost
  (:func:`privlearn.accounting.as_replace_one`, group privacy of size 2).
* **Two composition rules.** A budget created with ``adaptive=False`` (default) caps the
  tight composition of the releases, valid when the *sequence of mechanisms* is fixed
  in advance (outputs may feed later releases' inputs, as in ordinary adaptive
  composition, but not their noise levels or number). When the choice of later releases
  depends on earlier outputs (fully adaptive composition), create the budget with
  ``adaptive=True``: the cap is then enforced by a Renyi filter (Feldman & Zrnic 2021;
  :mod:`privlearn.ledger._filter`) at one order fixed when the budget is created, which is
  valid under full adaptivity but admits less than the tight total; both numbers are in
  :class:`Spent`.

Reserve / settle (for long runs such as DP-SGD)
-----------------------------------------------
``r = ledger.reserve(dataset, plan)`` records the whole plan (e.g. ``compose(step, T)``)
before training starts; ``r.settle(compose(step, steps=k))`` records that only ``k`` steps
ran (the actual mechanism must be covered by the plan: a sub-composition). Until settled
the plan counts in full, so a process killed at step ``k`` leaves at least ``k`` steps (in
fact all ``T``) in the ledger. ``ledger.pending(dataset)`` lists unsettled reservations.
"""

from privlearn.errors import (
    BudgetExceededError,
    LedgerBusyError,
    LedgerConflictError,
    LedgerIntegrityError,
    LedgerNotFoundError,
    LedgerStorageError,
    NotALedgerError,
    UnknownBudgetError,
)
from privlearn.ledger._filter import default_filter_order, filter_epsilon
from privlearn.ledger._ledger import (
    Budget,
    BudgetHandle,
    Entry,
    Ledger,
    Reservation,
    Spent,
    VerifyReport,
    check_privacy_unit,
)

__all__ = [
    "Budget",
    "BudgetExceededError",
    "BudgetHandle",
    "Entry",
    "Ledger",
    "LedgerBusyError",
    "LedgerConflictError",
    "LedgerIntegrityError",
    "LedgerNotFoundError",
    "LedgerStorageError",
    "NotALedgerError",
    "UnknownBudgetError",
    "Reservation",
    "Spent",
    "VerifyReport",
    "check_privacy_unit",
    "default_filter_order",
    "filter_epsilon",
]
