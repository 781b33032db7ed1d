"""Every exception and warning class of privlearn, in one leaf module.

It imports nothing from the package, so any layer (accounting, models, torch, auditing,
ledger, the CLI) can raise or catch these without import cycles. The packages that raise
them re-export the public ones (``privlearn.accounting.AccountingError``,
``privlearn.ledger.LedgerIntegrityError``, ...); both names are the same class.

Every error subclasses the built-in that fits (``ValueError`` for a value that is not
allowed, ``TypeError`` for a wrong type, ``ArithmeticError`` for a numerical computation
that cannot be certified, ``RuntimeError`` for a refusal caused by state), so callers can
catch either. Callers that map errors to outcomes -- the ``privlearn`` command line maps
them to exit statuses and hints -- switch on these types, never on message text:

=================================  ==========================================  ===========
class                              raised when                                 CLI status
=================================  ==========================================  ===========
:class:`ParameterValueError`       a parameter value is out of range           2
:class:`ParameterTypeError`        a parameter has the wrong type              2
:class:`ConfigurationError`        settings that contradict one another        2
:class:`PlanMismatchError`         what ran differs from what was accounted    2
:class:`UnsupportedMechanismError` an accountant cannot evaluate a mechanism   2
:class:`AccountingError`           a result cannot be certified (and its       2
                                   subclasses :class:`CertificationError`,
                                   :class:`PrivacyLossOverflowError`)
:class:`CalibrationError`          a calibration target cannot be met          2
                                   (and its subclass
                                   :class:`AutodpCalibrationError`)
:class:`LedgerNotFoundError`       no ledger file at the path                  2
:class:`UnknownBudgetError`        no budget for the dataset in the ledger     2
:class:`LedgerConflictError`       a request contradicts the ledger's state    2
:class:`LedgerBusyError`           another writer held the ledger past         2
                                   ``timeout`` (nothing recorded)
:class:`LedgerStorageError`        the ledger's file could not be written or   2
                                   read (disk full, I/O error; nothing
                                   recorded)
:class:`DataNotFoundError`         a dataset's files are not found             2
:class:`DataFormatError`           a dataset's file is not in its format       2
:class:`BudgetExceededError`       a spend would exceed the ledger's budget    3
:class:`LedgerIntegrityError`      the ledger file was tampered with           4
=================================  ==========================================  ===========

The PyTorch engine's refusals are :class:`UnsupportedModuleError` (a layer per-example
clipping cannot handle), :class:`BatchDependenceError` (an operation mixes examples, or
a layer carries the batch on another dimension than declared) and
:class:`NonFiniteInputError` (a NaN or inf in an example's input or gradient; the
estimators raise it too, for a NaN or inf in ``X`` or ``y``); all are ``ValueError``.
A misuse of the training loop (a second ``backward()`` before ``step()``, ``step()`` on
the wrapped optimizer, a step with no per-example gradient recorded) is a
:class:`TrainingLoopError`, a ``RuntimeError``.
"""

from __future__ import annotations

__all__ = [
    "StrategyOptimizationError",
    "PrivacyLeakWarning",
    "GradientOverflowWarning",
    "AutodpArgumentWarning",
    "ParameterValueError",
    "ParameterTypeError",
    "ConfigurationError",
    "PlanMismatchError",
    "AccountingError",
    "CertificationError",
    "PrivacyLossOverflowError",
    "UnsupportedMechanismError",
    "CalibrationError",
    "AutodpCalibrationError",
    "PrivacyBudgetExceededError",
    "BudgetExceededError",
    "LedgerIntegrityError",
    "LedgerNotFoundError",
    "NotALedgerError",
    "UnknownBudgetError",
    "LedgerConflictError",
    "LedgerBusyError",
    "LedgerStorageError",
    "DataNotFoundError",
    "DataFormatError",
    "DataClippedWarning",
    "PrivacyBudgetWarning",
    "StrategyAdjustedWarning",
    "NoiseRoundingWarning",
    "UntestedTorchWarning",
    "UnsupportedModuleError",
    "BatchDependenceError",
    "NonFiniteInputError",
    "TrainingLoopError",
    "RanksNotArrivedError",
]


# ----------------------------------------------------------------------------------
# warnings
# ----------------------------------------------------------------------------------
class PrivacyLeakWarning(UserWarning):
    """A non-private choice was made explicitly (for example a data-dependent default
    was opted into, or a parameter was set that releases un-noised information).

    Emitted to the person who runs the computation; the released object is then *not*
    covered by the accounted mechanism for the part the warning names.
    """


class GradientOverflowWarning(RuntimeWarning):
    """Some examples' (loss-scaled) per-example gradients were not finite (fp16
    overflow) and were left out of the clipped sum: they contributed zero to the step.

    Emitted to the person who runs the training loop (it reports a count of examples,
    which is not released by the training); the released update stays covered by the
    accounted mechanism (dropping an example keeps its contribution within the clipping
    bound).
    """


class AutodpArgumentWarning(UserWarning):
    """An autodp argument was accepted but has no effect in privlearn's autodp facade
    (:mod:`privlearn.compat.autodp`; the message says why). Never emitted for arguments
    left at autodp's defaults."""


# ----------------------------------------------------------------------------------
# parameters
# ----------------------------------------------------------------------------------
class ParameterValueError(ValueError):
    """A parameter has the right type but a value that is not allowed (out of range,
    NaN, infinite where a finite number is needed, an unknown choice). The message names
    the parameter, the valid range, the value received and what to try instead."""


class ConfigurationError(ParameterValueError):
    """Settings that are each allowed but contradict one another, or a registration
    that conflicts with one already made (a name taken by another experiment or
    accountant). The message names the settings and what to change."""


class PlanMismatchError(ConfigurationError, RuntimeError):
    """What ran differs from what was planned and accounted for: an estimator whose fit
    ran another mechanism than its settings declare, a training run whose noise
    multiplier or number of steps differs from the plan it was built for, a module named
    as the provider of a built-in accountant that did not register it. Raised before
    the result is released. Also a ``RuntimeError`` (the type these refusals had)."""


class ParameterTypeError(TypeError, ValueError):
    """A parameter of the wrong type (a string, ``None`` or a list where a number is
    expected). It is a :class:`TypeError` and also a :class:`ValueError`, as
    scikit-learn's ``InvalidParameterError`` is, so that one ``except ValueError`` catches
    every invalid parameter of an estimator."""


# ----------------------------------------------------------------------------------
# accounting
# ----------------------------------------------------------------------------------
class AccountingError(ArithmeticError):
    """A numerical computation could not reach a certified result.

    Raised instead of returning nan, 0 or an optimistic value.
    """


class StrategyOptimizationError(AccountingError):
    """A correlated-noise strategy optimisation produced no finite loss (a numerical
    failure; never a strategy returned silently)."""


class CertificationError(AccountingError):
    """The accountant's certified error terms are larger than the quantity asked for
    (e.g. a delta far below the FFT round-off of a very long composition): no certified
    value exists at this precision. Another accountant (``"rdp"``) or a larger target
    usually answers."""


class PrivacyLossOverflowError(AccountingError, OverflowError):
    """The privacy loss of a step is too large to represent in floating point: the
    mechanism is essentially non-private at these parameters (more noise is needed)."""


class UnsupportedMechanismError(ValueError):
    """The chosen accountant cannot evaluate (part of) this mechanism."""


class CalibrationError(ValueError):
    """The calibration target cannot be met within the parameter bounds (or the
    accountant failed during the search: the cause is chained as ``__cause__``)."""


class AutodpCalibrationError(CalibrationError, RuntimeError):
    """A calibrator of the autodp facade (:mod:`privlearn.compat.autodp.calibrator_zoo`)
    cannot meet its target within the bounds: a :class:`CalibrationError` that is also
    the ``RuntimeError`` autodp's calibrators raise, so ported code catching either keeps
    working. The error it replaces is chained as ``__cause__``."""


# ----------------------------------------------------------------------------------
# budgets and the privacy ledger
# ----------------------------------------------------------------------------------
class PrivacyBudgetExceededError(RuntimeError):
    """A step or release would take the privacy loss past a cap the user set
    (``make_private(..., max_epsilon=...)``); raised *before* the step runs."""


class BudgetExceededError(PrivacyBudgetExceededError):
    """A spend against a persistent privacy ledger would exceed the dataset's budget;
    nothing was recorded and the data was not touched."""


class LedgerIntegrityError(RuntimeError):
    """The ledger file failed its integrity check: an entry was edited or removed, the
    chain truncated, or the file rolled back behind a head this process had seen.

    Nothing is reported or appended until the file verifies again (restore it from a
    backup; :meth:`privlearn.ledger.Ledger.verify` lists what was found).

    Attributes
    ----------
    problems : tuple of str
        What the check found, one sentence each.
    """

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class LedgerNotFoundError(FileNotFoundError):
    """No privacy ledger at the given path (and creating one was not asked for), or a
    path where none can be: a directory, or a file in a directory that does not exist.

    Attributes
    ----------
    path : str or None
        The path given.
    reason : str or None
        ``"missing"`` (no file), ``"empty"`` (an empty file), ``"directory"`` (the path
        is a directory), ``"no_directory"`` (its directory does not exist),
        ``"unopenable"`` (the file cannot be opened), ``"not_a_file"`` (a device, pipe
        or socket), ``"in_memory"`` (SQLite's ``":memory:"``, whose budget would not
        outlive its connection) or ``"other_ledger"`` (a handle
        unpickled where the file at its path is not the ledger it was pickled from).
    """

    def __init__(self, message: str, *, path: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NotALedgerError(LedgerNotFoundError, LedgerIntegrityError):
    """The file at the path is not a privacy ledger at all: not an SQLite database (a text
    file, random bytes), or an SQLite database without the ledger's tables. No ledger is
    at that path (a :class:`LedgerNotFoundError`, reason ``"not_a_ledger"``: pass the path
    of a ledger, or create one at a path where no file exists); it is also a
    :class:`LedgerIntegrityError`, which it was before it had its own type. A ledger whose
    file is damaged or whose entries fail verification raises
    :class:`LedgerIntegrityError` alone.

    Attributes
    ----------
    path : str
        The path given.
    reason : str
        ``"not_a_ledger"``.
    problems : tuple of str
        ``("not a privacy ledger",)``.
    """

    def __init__(self, message: str, *, path: str) -> None:
        LedgerNotFoundError.__init__(self, message, path=path, reason="not_a_ledger")
        self.problems = ("not a privacy ledger",)


class UnknownBudgetError(KeyError):
    """The ledger has no budget for this dataset (and privacy unit).

    Attributes
    ----------
    dataset, privacy_unit, path : str or None
        The budget asked for, and the ledger's path.
    known : tuple of str
        The budgets the ledger holds, as ``dataset/unit``.
    """

    def __init__(self, message: str, *, dataset: str | None = None,
                 privacy_unit: str | None = None, path: str | None = None,
                 known: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.dataset, self.privacy_unit, self.path = dataset, privacy_unit, path
        self.known = tuple(known)

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0]) if self.args else ""


class LedgerConflictError(ValueError):
    """A request contradicts what the ledger holds: a budget that already exists, a
    reservation that is unknown or already settled, a settlement its plan does not
    cover, a release accounted per another privacy unit or under another neighbouring
    relation than the budget's. Nothing was recorded.

    Attributes
    ----------
    existing, asked : Budget or None
        For a budget that already exists: the budget the ledger holds and the one asked
        for (None for the other conflicts), so that a caller can say what to do in its
        own words (the command line names its options).
    """

    def __init__(self, message: str, *, existing: object = None,
                 asked: object = None) -> None:
        super().__init__(message)
        self.existing, self.asked = existing, asked


class LedgerBusyError(TimeoutError):
    """Another writer held the ledger's write lock for longer than the ``timeout`` this
    :class:`~privlearn.ledger.Ledger` waits: the request was abandoned and nothing was
    recorded (try again, pass a larger ``timeout=``, or find the process that holds a
    write transaction open on the file).

    Attributes
    ----------
    path : str
        The ledger's file.
    timeout : float
        The seconds waited.
    """

    def __init__(self, message: str, *, path: str, timeout: float) -> None:
        super().__init__(message)
        self.path, self.timeout = path, timeout

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LedgerStorageError(OSError):
    """The ledger's file could not be written or read: the disk (or the quota, or the
    file size limit) is full, an I/O error, a file system that became read-only. The
    request was abandoned and nothing was recorded (the transaction rolled back; what
    returned before is on disk).

    Attributes
    ----------
    path : str
        The ledger's file.
    reason : str
        ``"full"``, ``"io"``, ``"readonly"`` or ``"unopenable"``.
    """

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        super().__init__(message)
        self.path, self.reason = path, reason

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# ----------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------
class DataNotFoundError(FileNotFoundError):
    """A dataset's files are not in any of the documented places (and ``download`` was
    not asked for). The message is one line naming the places searched and what to do.

    Attributes
    ----------
    what : str or None
        The files missing, e.g. ``"MNIST files"``.
    searched : tuple of str
        The directories searched, in order.
    """

    def __init__(self, message: str, *, what: str | None = None, searched=()) -> None:
        super().__init__(message)
        self.what = what
        self.searched = tuple(str(d) for d in searched)


class DataFormatError(ValueError):
    """A data file is not in the format it should be (a truncated or foreign file in
    place of a dataset's file); re-download it."""


# ----------------------------------------------------------------------------------
# the estimators and the PyTorch engine
# ----------------------------------------------------------------------------------
class DataClippedWarning(UserWarning):
    """Clipping changed some rows or labels of the training data.

    Addressed to the person calling ``fit`` (who sees the data anyway); the counts it
    reports are never stored on the fitted object, which would release them un-noised.
    Silence it with ``warnings.simplefilter("ignore", DataClippedWarning)``.
    """


class PrivacyBudgetWarning(UserWarning):
    """Training went past the epsilon it was planned (calibrated) for."""


class StrategyAdjustedWarning(UserWarning):
    """A correlated-noise strategy uses less than it was asked for: bands past the
    participation separation left at zero, more bands than steps, more BLT buffers than
    the optimum uses. The message says what is used and why; the run is accounted for
    what is used."""


class NoiseRoundingWarning(UserWarning):
    """The accounting of a correlated-noise run charges more than 1 % of its sensitivity
    for the floating point of its noise recurrence (a BLT over very many steps in
    float32). The run is accounted for it; the message says how to charge less (the
    noise in float64: ``secure_mode=True`` or float64 parameters; fewer steps or
    buffers)."""


class UntestedTorchWarning(UserWarning):
    """The installed PyTorch is supported but newer than any the test suite runs on."""


class UnsupportedModuleError(ValueError):
    """The model has layers that per-example clipping cannot handle (all listed)."""


class BatchDependenceError(ValueError):
    """An example's data reaches other examples' values (batch mixing), or a layer
    receives the batch on another dimension than the engine reads; raised before the
    step, nothing released."""


class NonFiniteInputError(ValueError):
    """An example's input (or, with no loss scaler in use, its per-example gradient) is
    not finite (NaN or inf); raised before the step, nothing released, naming the input
    and the example. The estimators of :mod:`privlearn.models` raise it for a NaN or an
    infinity in ``X`` or ``y``, before anything is released (a ledger reservation made
    before the data was read is still charged in full: whether the data is refused
    depends on its values, which a cancelled entry would reveal)."""


class TrainingLoopError(RuntimeError):
    """The training loop used the engine in a way it cannot account or clip (a second
    ``backward()`` before ``step()``, ``step()`` on the optimizer given to
    ``make_private`` instead of ``p.optimizer``, a layer run in eval mode, trainable
    parameters changed mid-step, pickling the model while the engine is attached: save
    ``p.state_dict()`` or ``p.detach()`` first); raised before the step, nothing
    released. A ``RuntimeError``: a refusal caused by the loop's state, not by a parameter."""


class RanksNotArrivedError(TrainingLoopError, TimeoutError):
    """Some ranks of a distributed run did not reach ``make_private`` within its
    ``agreement_timeout`` (seconds; a rank that skipped it, or failed or stopped before
    it): raised on the ranks that were waiting, naming the ranks that did not arrive
    where the backend says (gloo), before anything is released. Both a
    :class:`TrainingLoopError` and a ``TimeoutError``."""
