"""A persistent, tamper-evident privacy ledger in SQLite (see :mod:`privlearn.ledger`).

The :class:`Ledger`: storage (the schema, the transaction discipline -- BEGIN
IMMEDIATE, hash chain, head record -- and its integrity checks) and the budget
operations that run inside it. Its value objects are in ``_records``, the reading of
releases under a budget's neighbouring relation in ``_relations``, the reservation and
budget handles in ``_handles``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import sqlite3
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

if sys.platform != "win32":
    import fcntl
else:  # pragma: no cover - Windows: SQLite's own locking only
    fcntl = None

from privlearn._validation import check_delta, check_positive
from privlearn.accounting import (
    Composed,
    Mechanism,
    Neighbouring,
    get_accountant,
)
from privlearn.accounting.serialization import loads
from privlearn.errors import (
    AccountingError,
    BudgetExceededError,
    LedgerConflictError,
    LedgerIntegrityError,
    LedgerNotFoundError,
    LedgerStorageError,
    ParameterTypeError,
    ParameterValueError,
    UnknownBudgetError,
)
from privlearn.ledger._busy import (
    DEFAULT_TIMEOUT,
    as_busy_error,
    end_transaction,
    lock_file,
    lock_timeout_refused,
)
from privlearn.ledger._filter import filter_order, payload_metadata, reported_payload
from privlearn.ledger._handles import (
    BudgetHandle,
    ClosedConnection,
    KeylessConnection,
    MissingLedgerConnection,
    OtherLedgerConnection,
    Reservation,
    _check_unit,
    holds_head,
    pickled_head,
)
from privlearn.ledger._moved import file_identity, follow_file
from privlearn.ledger._records import (
    Budget,
    Entry,
    Spent,
    VerifyReport,
    _check_head,
    _check_mechanism,
    _check_name,
    _check_opt_str,
    _check_seq,
    _check_who,
    _default_who,
    _now,
    budget_conflict,
    check_metadata,
)
from privlearn.ledger._relations import (
    _check_budget_relation,
    _check_relation,
    _covered,
    _relation,
    check_privacy_unit,
)
from privlearn.ledger._schema import (
    _COLUMNS,
    _CONTENT_KEYS,
    _ENCODE,
    GENESIS,
    check_ledger_path,
    home_hint,
    open_schema,
    read_only_uri,
    refuse_foreign_database,
    unreadable_file_error,
)
from privlearn.ledger._summary import summary
from privlearn.ledger._tally import Releases, read_releases, read_tally

__all__ = ["Budget", "BudgetHandle", "Entry", "Ledger", "Reservation", "Spent", "VerifyReport",
           "check_privacy_unit"]

# ----------------------------------------------------------------------------------
# the ledger
# ----------------------------------------------------------------------------------


class Ledger:
    """A persistent privacy ledger: one budget per dataset (and privacy unit), append-only,
    hash-chained entries, atomic check-and-append, refused when tampered with.

    Parameters
    ----------
    path : str or PathLike
        SQLite file. Opened in WAL mode with ``synchronous=FULL``: a spend that returned
        is on disk, and concurrent writers are serialised by ``BEGIN IMMEDIATE``
        transactions. SQLite keeps ``PATH-wal`` / ``PATH-shm`` next to it, and writers
        queue on an empty ``PATH-writelock`` file (POSIX; all three next to the file a
        symbolic link names); copy the ledger with SQLite's backup API or after closing
        every connection.
    create : bool
        Create the ledger when there is none at ``path`` (default False: a missing file
        raises :class:`~privlearn.errors.LedgerNotFoundError`, so a mistyped path is an
        error, not a fresh empty budget).
    key : bytes, optional
        Secret for HMAC-SHA256 entry hashes. Without a key the chain is plain SHA-256: it
        detects editing, deleting and truncating rows by anyone who does not also
        recompute the chain; with a key (kept outside the file) nobody without the key
        can forge a consistent chain. Record :meth:`head` elsewhere for the same effect.
    timeout : float
        Seconds to wait for another writer's lock; then LedgerBusyError, nothing recorded.
    read_only : bool, optional
        Open the file read-only (reports and :meth:`verify` work; every write raises
        :class:`~privlearn.errors.LedgerStorageError`). Default: read-only exactly when
        this process may not write the file.

    Notes
    -----
    Integrity is checked before every report and every append: every public method but
    :meth:`verify` and :meth:`close` raises :class:`~privlearn.errors.LedgerIntegrityError`
    while the file fails the checks of :meth:`verify` or no longer extends the head this
    object last verified (entries removed with the head rewritten), so no path returns a
    total computed from a tampered file. The full check (re-hashing every entry, 10-20 ms
    per 1,000 entries) runs when the object first reads the file and again only when
    another connection has committed since (SQLite's ``PRAGMA data_version``); between
    the object's own appends it costs one query. The object keeps each budget's counted
    releases merged into ``(mechanism, count)`` parts, with the chain head they cover, and
    reads only the entries appended after it, so a spend costs what composing the
    distinct mechanisms costs, whatever the number of entries.

    Raises
    ------
    LedgerNotFoundError
        No ledger at ``path`` and ``create`` is False.
    LedgerIntegrityError
        ``path`` is not a privacy ledger (another SQLite database, or not a database).
    LedgerStorageError
        The file cannot be written or read (a full disk, an I/O error), here or in any
        later call; nothing is recorded.

    Examples
    --------
    >>> import tempfile, os
    >>> from privlearn.accounting import Gaussian
    >>> from privlearn.ledger import Ledger
    >>> led = Ledger(os.path.join(tempfile.mkdtemp(), "budget.db"), create=True)
    >>> _ = led.create_budget("adult", epsilon=2.0, delta=1e-6)
    >>> _ = led.spend("adult", Gaussian(4.0), label="mean age")
    >>> led.spent("adult").epsilon_spent < 2.0
    True
    """

    def __init__(self, path: str | os.PathLike, *, create: bool = False,
                 key: bytes | None = None, timeout: float = DEFAULT_TIMEOUT,
                 read_only: bool | None = None):
        if key is not None and not isinstance(key, bytes):
            raise ParameterTypeError(f"key must be bytes or None, got {type(key).__name__}")
        if key is not None and not key:
            raise ParameterValueError(
                "key must be a non-empty secret (bytes) or None, got b''; pass the ledger's "
                "HMAC key, or None for an unkeyed ledger")
        if not isinstance(create, bool):
            raise ParameterTypeError(f"create must be a bool, got {create!r}")
        if not isinstance(path, str | os.PathLike):
            raise ParameterTypeError(f"path must be a file path (str or PathLike), got {path!r}")
        self.path = str(Path(path))
        self._abs = os.path.abspath(self.path)  # the file, whatever the cwd later becomes
        self._key = key
        self._timeout = check_positive("timeout", timeout)
        self._lock = threading.RLock()
        self._parsed: dict[str, Mechanism] = {}
        self._tallies: dict = {}  # (dataset, unit) -> its Tally, see _tally
        # integrity state: the head last verified, the data_version it was verified at,
        # and the failure found (with its data_version) until the file verifies again
        self._seen: tuple[int, str] | None = None
        self._verified_version: int | None = None
        self._failure: tuple[int, LedgerIntegrityError] | None = None
        self._appended: tuple[int, str] | None = None
        check_ledger_path(self.path)  # an existing directory; not a directory or device
        if read_only is None:  # a file this process may not write: read it read-only
            read_only = not create and os.path.isfile(self.path) and not os.access(
                self.path, os.W_OK)
        if not isinstance(read_only, bool) or (read_only and create):
            raise ParameterValueError(f"read_only must be a bool (None: the file's own "
                                      f"permission), and not with create=True, got "
                                      f"{read_only!r}")
        self.read_only = read_only
        if not create and not os.path.exists(self.path):
            raise LedgerNotFoundError(
                f"no privacy ledger at {self.path}; check the path, or pass create=True to "
                "create one (`privlearn budget init` creates one from the shell)"
                + home_hint(self.path), path=self.path, reason="missing")
        if create:  # owner-only (0600): a ledger lists what was released from which data
            with contextlib.suppress(OSError):  # exists (mode kept), or SQLite reports it
                # the file a symbolic link names (O_EXCL on the link itself fails)
                os.close(os.open(os.path.realpath(self.path),
                                 os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        self._conn = self._connect(create)
        self._ident = file_identity(self._abs)  # the file opened (see _moved)

    # -- connection / pickling ----------------------------------------------------------
    def _connect(self, create: bool) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                read_only_uri(self._abs) if self.read_only else self.path, timeout=self._timeout,
                isolation_level=None, check_same_thread=False, uri=self.read_only)
        except sqlite3.OperationalError as exc:  # e.g. a directory we may not write in
            raise LedgerNotFoundError(
                f"cannot open the privacy ledger at {self.path} ({exc}); check that the "
                "path is a file in a directory you may write in",
                path=self.path, reason="unopenable") from None
        try:
            return self._open_schema(conn, create)
        except (sqlite3.OperationalError, LedgerStorageError) as exc:
            conn.close()
            cause = exc if isinstance(exc, sqlite3.Error) else exc.__context__
            typed = as_busy_error(cause, self.path, self._timeout)  # disk full: as it is
            if getattr(typed, "reason", None) not in ("readonly", "unopenable"):
                raise typed from None
            raise LedgerNotFoundError(
                f"cannot open the privacy ledger at {self.path} ({cause}); check that the "
                "path is a file you may read and write, in a directory you may write in",
                path=self.path, reason="unopenable") from None
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise unreadable_file_error(self.path, self._abs, exc) from None
        except BaseException:
            conn.close()
            raise

    def _open_schema(self, conn: sqlite3.Connection, create: bool) -> sqlite3.Connection:
        # milliseconds in a C int: a longer wait (~25 days) wrapped to 0, i.e. no wait at all
        conn.execute(f"PRAGMA busy_timeout={int(min(self._timeout * 1000, 2**31 - 1))}")
        refuse_foreign_database(conn, self.path)  # before WAL, which rewrites the header
        if not self.read_only:  # a read-only connection reads the file's journal mode
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
        opened = (self._read(conn, check=False) if self.read_only
                  else self._write(conn, check=False))
        with opened as cur:
            open_schema(cur, self.path, self._key is not None, create)
        return conn

    def close(self) -> None:
        """Close the database connection; later use raises a typed error."""
        with self._lock:
            self._conn.close()
            self._conn = ClosedConnection(self.path)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # never the HMAC key, a secret: a pickle (e.g. of a fitted estimator holding a
        # budget of this ledger, a release) may be published
        # the head, to recognise the file where the pickle is loaded (docs/trust-model.md)
        return {"path": self._abs, "keyed": self._key is not None, "timeout": self._timeout,
                "head": pickled_head(self)}

    def __setstate__(self, state: dict) -> None:
        conn, head = None, state.get("head")
        if not state.get("keyed") or state.get("key") is not None:  # "key": older pickles
            try:
                self.__init__(state["path"], key=state.get("key"), timeout=state["timeout"])
                if head is None or holds_head(self._conn, head):
                    return
                self._conn.close()  # another ledger at this path: never read nor spent
                conn = OtherLedgerConnection(state["path"], tuple(head))
            except LedgerNotFoundError as exc:  # e.g. a shared model: it loads, never spends
                conn = MissingLedgerConnection(state["path"], exc.reason)
        self.path, self._key, self._timeout = state["path"], None, state["timeout"]
        self._abs = os.path.abspath(self.path)
        self._lock, self._parsed, self._tallies = threading.RLock(), {}, {}
        self._seen = self._verified_version = self._failure = self._appended = None
        self._ident = None
        if head is not None:  # kept for a pickle of this copy (it never reads the file)
            self._seen = (int(head[0]), str(head[1]))
        self._conn = conn or KeylessConnection(self.path)  # refuses every use

    def __deepcopy__(self, memo) -> Ledger:
        return self  # a handle on shared external state, not a value

    def __copy__(self) -> Ledger:
        return self

    def __repr__(self) -> str:
        return f"Ledger({self.path!r})"

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """Queue writers of this file on an OS lock (``flock`` on POSIX) so they wake as
        soon as the previous one commits, instead of in SQLite's busy-wait back-off.
        Correctness does not depend on it: ``BEGIN IMMEDIATE`` serialises writers anyway."""
        if fcntl is None:  # pragma: no cover - Windows
            yield
            return
        lock = os.path.realpath(self._abs) + "-writelock"  # one per file, whatever its path
        try:
            # created with the ledger's own permissions (0600 for a ledger created here)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, os.stat(self._abs).st_mode & 0o666)
        except OSError as exc:  # e.g. a ledger (and its lock file) another user owns
            raise LedgerNotFoundError(
                f"cannot open the privacy ledger at {self.path}: its lock file {lock} "
                f"cannot be opened for writing ({exc.strerror or exc}); every use of a "
                "ledger takes it, so check that you may read and write the ledger's files "
                "and create files in its directory", path=self.path, reason="unopenable",
            ) from None
        try:
            lock_file(fd, self.path, self._timeout)
            yield
        finally:
            os.close(fd)  # releases the lock

    @contextlib.contextmanager
    def _write(self, conn: sqlite3.Connection | None = None, *, check: bool = True
               ) -> Iterator[sqlite3.Cursor]:
        """One ``BEGIN IMMEDIATE`` transaction, the file's integrity checked first."""
        with self._lock:
            conn = conn or follow_file(self)  # the file now at the path (see _moved)
            cur = conn.cursor()  # first: an unpickled handle that cannot spend says why
            with self._file_lock(), lock_timeout_refused(conn, self.path, self._timeout):
                cur.execute("BEGIN IMMEDIATE")
                self._appended = None
                try:
                    if check:
                        self._ensure_intact(cur)
                    yield cur
                except BaseException:
                    end_transaction(conn, "ROLLBACK")
                    raise
                else:
                    cur.execute("COMMIT")
                    if self._appended is not None and check:
                        self._seen = self._appended  # our appends extend the verified chain

    @contextlib.contextmanager
    def _read(self, conn: sqlite3.Connection | None = None, *, check: bool = True
              ) -> Iterator[sqlite3.Cursor]:
        """One read transaction (a consistent snapshot), the file's integrity checked."""
        with self._lock:
            conn = conn or follow_file(self)
        with self._lock, lock_timeout_refused(conn, self.path, self._timeout):
            cur = conn.cursor()
            cur.execute("BEGIN")
            try:
                if check:
                    self._ensure_intact(cur)
                yield cur
            except BaseException:
                # unless SQLite ended it (an I/O error): that error is the one to report
                end_transaction(conn, "ROLLBACK")
                raise
            else:
                cur.execute("COMMIT")

    # -- integrity -------------------------------------------------------------------
    def _ensure_intact(self, cur: sqlite3.Cursor) -> None:
        """Raise :class:`LedgerIntegrityError` unless the snapshot read by ``cur`` passes
        the chain checks and extends the head this object last verified.

        Inside the transaction (so that the check and what follows read one snapshot).
        The chain is re-hashed only when another connection committed since the last
        check (``PRAGMA data_version`` changed; this object's own appends keep the chain
        valid by construction and update the verified head)."""
        head = cur.execute("SELECT count, hash FROM head WHERE id=1").fetchone()  # snapshot
        version = cur.execute("PRAGMA data_version").fetchone()[0]
        if self._failure is not None and self._failure[0] == version:
            raise self._failure[1]
        if version == self._verified_version and head is not None and (
                (int(head[0]), str(head[1])) == self._seen):
            return
        problems, _ = self._chain_problems(cur, [self._seen] if self._seen else [])
        if problems:
            err = LedgerIntegrityError(
                f"ledger {self.path} failed its integrity check ({'; '.join(problems)}); "
                "nothing is reported or recorded until it verifies again: restore the file "
                "from a backup (`privlearn budget verify PATH` lists what was found)",
                tuple(problems))
            self._failure = (version, err)
            raise err
        self._mark_verified(cur)

    def _mark_verified(self, cur: sqlite3.Cursor) -> None:
        """Record the snapshot read by ``cur`` as verified."""
        count, h = cur.execute("SELECT count, hash FROM head WHERE id=1").fetchone()
        self._failure = None
        self._verified_version = cur.execute("PRAGMA data_version").fetchone()[0]
        self._seen = (int(count), str(h))

    def _chain_problems(self, cur: sqlite3.Cursor, anchors: Sequence[tuple[int, str]],
                        *, parse: bool = False) -> tuple[list[str], int]:
        """What is wrong with the file read by ``cur`` (empty when intact), and the number
        of entries. Checks every entry's hash, its link to the previous one, the sequence
        numbers, the head record (truncation), optionally that every mechanism parses,
        and that the chain extends every head in ``anchors`` (``(count, hash)`` recorded
        earlier)."""
        try:
            rows = cur.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq").fetchall()
            head = cur.execute("SELECT count, hash FROM head WHERE id=1").fetchone()
            keyed = cur.execute("SELECT value FROM meta WHERE key='keyed'").fetchone()
        except sqlite3.DatabaseError as exc:
            return [f"unreadable ledger: {exc}"], 0
        problems: list[str] = []
        if keyed is not None and (keyed[0] == "1") != (self._key is not None):
            problems.append(
                "the ledger was created " + ("with" if keyed[0] == "1" else "without")
                + " an HMAC key and opened " + ("with" if self._key else "without")
                + " one: hashes cannot match"
            )
        prev = GENESIS
        for i, r in enumerate(rows, start=1):
            if r[0] != i:
                problems.append(f"entry {i} is missing (found seq {r[0]} in its place)")
                break
            if r[10] != prev:
                problems.append(f"entry {i}: link to the previous entry is broken")
            if self._hash(r[10], self._content(r)) != r[11]:
                problems.append(f"entry {i}: content does not match its hash (edited)")
            if parse and r[4] is not None:
                try:
                    loads(r[4])
                except (ValueError, TypeError) as exc:
                    problems.append(f"entry {i}: unreadable mechanism ({exc})")
            prev = r[11]
        if head is None:
            problems.append("the head record is missing")
        else:
            if head[0] != len(rows):
                problems.append(
                    f"the head records {head[0]} entries but {len(rows)} are present "
                    "(truncated or removed)"
                )
            if head[1] != prev:
                problems.append("the head hash does not match the last entry")
        for count, h in anchors:
            if len(rows) < count or (count > 0 and rows[count - 1][11] != h):
                problems.append(
                    f"the ledger does not extend the head {count}:{h[:12]}... recorded "
                    "earlier (entries removed and the head rewritten, or the file rolled "
                    "back)")
                break
        return problems, len(rows)

    # -- hashing ---------------------------------------------------------------------
    def _hash(self, prev: str, row: dict) -> str:
        msg = (prev + "\n" + _ENCODE(row)).encode()
        if self._key is not None:
            return hmac.new(self._key, msg, hashlib.sha256).hexdigest()
        return hashlib.sha256(msg).hexdigest()

    @staticmethod
    def _content(r: Sequence) -> dict:
        return dict(zip(_CONTENT_KEYS, r[:10], strict=True))

    def _append(
        self,
        cur: sqlite3.Cursor,
        kind: str,
        dataset: str,
        unit: str,
        *,
        mechanism: str | None = None,
        payload: str | None = None,
        label: str | None = None,
        who: str | None = None,
        ref: int | None = None,
    ) -> tuple:
        """Append one entry (inside a :meth:`_write` transaction, which checked the file)."""
        count, prev = cur.execute("SELECT count, hash FROM head WHERE id = 1").fetchone()
        row = (count + 1, kind, dataset, unit, mechanism, payload, label, who, _now(), ref)
        h = self._hash(prev, self._content(row))
        cur.execute(f"INSERT INTO entries ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (*row, prev, h))
        cur.execute("UPDATE head SET count = ?, hash = ? WHERE id = 1", (count + 1, h))
        self._appended = (count + 1, h)  # the verified head once the transaction commits
        return (*row, prev, h)

    def _mech(self, text: str | None) -> Mechanism | None:
        if text is None:
            return None
        with self._lock:  # the parse cache is shared by the threads using this ledger
            m = self._parsed.get(text)
            if m is None:
                m = self._parsed[text] = loads(text)
            return m

    def _entry(self, r: Sequence) -> Entry:
        return Entry(seq=r[0], kind=r[1], dataset=r[2], privacy_unit=r[3],
                     mechanism=self._mech(r[4]), label=r[6], who=r[7], time=r[8], ref=r[9],
                     hash=r[11], metadata=payload_metadata(r[5]))

    # -- budgets ---------------------------------------------------------------------
    def create_budget(
        self,
        dataset: str,
        epsilon: float,
        delta: float,
        *,
        privacy_unit: str | None = None,
        accountant: str = "pld",
        adaptive: bool = False,
        adaptive_order: float | None = None,
        neighbouring: Neighbouring | str | None = None,
        who: str | None = None,
        exist_ok: bool = False,
    ) -> Budget:
        """Set the cap of ``dataset`` (once; a budget is never changed or removed).

        Parameters
        ----------
        dataset : str
        epsilon : float > 0
        delta : float in [0, 1)
            Every admitted history of releases is ``(epsilon, delta)``-DP.
        privacy_unit : str, optional
            What one "record" is (default ``"record"``; e.g. ``"user"``). Budgets are keyed
            by ``(dataset, privacy_unit)``.
        accountant : str
            Accountant that composes the releases (default ``"pld"``).
        adaptive : bool
            Enforce the cap with a Renyi filter (Feldman & Zrnic 2021), valid when the
            releases' mechanisms are chosen adaptively from earlier outputs. Default
            False: the cap is enforced on the tight composition of the releases, valid
            when the sequence of mechanisms does not depend on earlier outputs.
        adaptive_order : float > 1, optional
            The filter's order; default ``1 + 2 log(1/delta) / epsilon``.
        neighbouring : {"add_remove", "replace_one"} or Neighbouring, optional
            The neighbouring relation the cap holds under. ``"add_remove"``: every release
            must hold an add/remove guarantee (a replace-one release, e.g. fixed-size
            sampling, is refused). ``"replace_one"``: every release is counted under
            replace-one, an add/remove one at its replace-one cost
            (:func:`privlearn.accounting.as_replace_one`: twice its sensitivity,
            group privacy). Default None: the relation of the first release, replace-one
            if it holds a replace-one part, else add/remove.
        who : str, optional
            Who set the budget, recorded in its entry (default ``user@host``): one line
            of printable text, not blank (as ``spend``'s ``who``).
        exist_ok : bool
            What a budget already set for ``dataset`` (and ``privacy_unit``) does: with
            False (default) it raises :class:`~privlearn.errors.LedgerConflictError`; with
            True (a script that runs more than once) it is returned when it has exactly
            these settings, and any other setting raises ``LedgerConflictError``.
        """
        dataset = _check_name("dataset", dataset)
        unit = _check_unit(privacy_unit)
        epsilon = check_positive("epsilon", epsilon)
        delta = check_delta("delta", delta)
        acc = get_accountant(accountant).name
        order = filter_order(epsilon, delta, adaptive, adaptive_order)
        relation = _check_budget_relation(neighbouring)
        who = _check_who("who", who)
        if not isinstance(exist_ok, bool):
            raise ParameterTypeError(f"exist_ok must be a bool, got {exist_ok!r}")
        budget = Budget(dataset, unit, epsilon, delta, acc, adaptive, order, relation)
        payload = json.dumps(
            {"epsilon": epsilon, "delta": delta, "accountant": acc, "adaptive": adaptive,
             "adaptive_order": order,
             "neighbouring": None if relation is None else relation.value},
            sort_keys=True,
        )
        with self._write() as cur:
            if self._budget_row(cur, dataset, unit) is not None:
                existing = self._get_budget(cur, dataset, unit)
                if exist_ok and existing == budget:
                    return existing
                raise LedgerConflictError(
                    budget_conflict(self.path, existing, budget, exist_ok),
                    existing=existing, asked=budget)
            self._append(cur, "budget", dataset, unit, payload=payload,
                         who=who or _default_who())
        return budget

    def _budget_row(self, cur, dataset: str, unit: str):
        _check_name("dataset", dataset)  # every lookup of a budget: a clear error, not SQL's
        return cur.execute(
            "SELECT payload FROM entries WHERE kind='budget' AND dataset=? AND privacy_unit=?",
            (dataset, unit),
        ).fetchone()

    def _get_budget(self, cur, dataset: str, unit: str) -> Budget:
        row = self._budget_row(cur, dataset, unit)
        if row is None:
            known = [f"{d}/{u}" for d, u in cur.execute(
                "SELECT dataset, privacy_unit FROM entries WHERE kind='budget'")]
            raise UnknownBudgetError(
                f"no budget for dataset {dataset!r} (privacy unit {unit!r}) in {self.path}; "
                f"create one with create_budget (known: {', '.join(known) or 'none'})",
                dataset=dataset, privacy_unit=unit, path=self.path, known=tuple(known))
        p = json.loads(row[0])
        relation = p.get("neighbouring")  # absent: bound by the releases (see _relation)
        return Budget(dataset, unit, p["epsilon"], p["delta"], p["accountant"],
                      p["adaptive"], p["adaptive_order"],
                      None if relation is None else Neighbouring(relation))

    def budget_info(self, dataset: str, *, privacy_unit: str | None = None) -> Budget:
        """The :class:`Budget` of ``dataset``."""
        with self._read() as cur:
            return self._get_budget(cur, dataset, _check_unit(privacy_unit))

    def budgets(self) -> list[Budget]:
        """Every budget in the ledger."""
        with self._read() as cur:
            rows = cur.execute(
                "SELECT dataset, privacy_unit FROM entries WHERE kind='budget' ORDER BY seq"
            ).fetchall()
            return [self._get_budget(cur, d, u) for d, u in rows]

    def budget(self, dataset: str, *, privacy_unit: str | None = None) -> BudgetHandle:
        """A handle bound to one budget, to pass to estimators (``ledger=``)."""
        with self._read() as cur:
            self._get_budget(cur, dataset, _check_unit(privacy_unit))
        return BudgetHandle(self, dataset, _check_unit(privacy_unit))

    # -- accounting ------------------------------------------------------------------
    def _counted(self, cur, dataset: str, unit: str
                 ) -> tuple[Releases, int, int, float | None]:
        """The counted releases of a budget in entry order, the number of releases, of
        pending reservations, and the last reported total (see ``_tally``)."""
        return read_tally(self._tallies, cur, dataset, unit, self._mech).counted()

    def _summary(self, budget: Budget, mechs, n, pending, floor=None) -> Spent:
        return summary(budget, mechs, n, pending, floor)  # kept with the releases

    def _admit(self, cur, dataset: str, unit: str, mechanism: Mechanism, what: str) -> Spent:
        budget = self._get_budget(cur, dataset, unit)
        mechs, n, pending, floor = self._counted(cur, dataset, unit)
        _check_relation(budget, mechs.distinct, mechanism, what)
        try:
            if floor is None and mechs:  # first spend since a settle: what was reported
                floor = self._summary(budget, mechs, n, pending).epsilon_spent
            after = self._summary(budget, mechs.plus(mechanism), n + 1, pending, floor)
        except AccountingError as exc:
            raise BudgetExceededError(  # e.g. the releases' deltas add up past the cap
                f"{what} refused: dataset {dataset!r} would have no certified epsilon at "
                f"the budget's delta {budget.delta:g} ({exc}); the releases' own deltas "
                "may add up past it: spend a release with a smaller delta or more noise; "
                "nothing was recorded") from exc
        over = after.epsilon_spent > budget.epsilon
        if budget.adaptive:
            over = over or after.adaptive_epsilon > budget.epsilon
        if over:
            before = self._summary(budget, mechs, n, pending, floor)
            rule = (
                f"; Renyi filter at order {budget.adaptive_order:.4g}: "
                f"{after.adaptive_epsilon:.6g}" if budget.adaptive else ""
            )
            raise BudgetExceededError(
                f"{what} refused: dataset {dataset!r} would reach epsilon "
                f"{after.epsilon_spent:.6g}{rule} > budget {budget.epsilon:g} at delta "
                f"{budget.delta:g} (spent so far {before.epsilon_spent:.6g} over {n} "
                "release(s)); nothing was recorded"
            )
        return after

    def check(
        self, dataset: str, mechanism: Mechanism, *, privacy_unit: str | None = None
    ) -> Spent:
        """What :meth:`spend` would leave spent, or :class:`BudgetExceededError`; records
        nothing. Advisory only (another process may spend in between): use :meth:`spend`
        or :meth:`reserve` before touching the data."""
        mechanism, _ = _check_mechanism(mechanism)
        with self._read() as cur:
            return self._admit(cur, dataset, _check_unit(privacy_unit), mechanism, "spend")

    def spend(
        self,
        dataset: str,
        mechanism: Mechanism,
        *,
        label: str | None = None,
        who: str | None = None,
        privacy_unit: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Entry:
        """Record a release, atomically refusing it if it would exceed the budget.

        Call it *before* the release reads the data: when it raises, nothing was recorded.
        ``metadata``: text keys and values saying what ran beyond the mechanism
        (:attr:`Entry.metadata`), hash-chained with the entry.

        Raises
        ------
        BudgetExceededError
            The composed total (or the Renyi filter, for adaptive budgets) would exceed
            the cap.
        UnknownBudgetError
            No budget for ``dataset`` (a :class:`KeyError`).
        LedgerConflictError
            The release holds no guarantee under the budget's neighbouring relation
            (:attr:`Spent.neighbouring`; e.g. a replace-one release on an add/remove
            budget).
        LedgerIntegrityError
            The file was tampered with (see :class:`Ledger`).
        """
        return self._entry(self._record("spend", dataset, mechanism, label, who, privacy_unit,
                                        metadata=metadata))

    def reserve(
        self,
        dataset: str,
        mechanism: Mechanism,
        *,
        label: str | None = None,
        who: str | None = None,
        privacy_unit: str | None = None,
        extends: int | Reservation | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Reservation:
        """Record a *planned* release (e.g. a whole training run) before it starts.

        The plan counts as spent in full until :meth:`Reservation.settle` records what
        actually ran (which must be covered by the plan, e.g. a prefix of its steps), so a
        process killed mid-run leaves at least its plan in the ledger. Refused exactly as
        :meth:`spend`.

        ``extends``: an earlier reservation of the same run that this one extends (more
        steps than planned); the privacy loss counts in full either way, but the run is
        one release in :attr:`Spent.entries`. ``metadata``: as in :meth:`spend` (its
        settle entry repeats it).
        """
        ref = ref_hash = None
        if extends is not None:
            ref = _check_seq("extends", extends.seq if isinstance(extends, Reservation)
                             else extends)
            if isinstance(extends, Reservation):
                ref_hash = extends.entry.hash
        row = self._record("reserve", dataset, mechanism, label, who, privacy_unit, ref,
                           ref_hash, metadata)
        return Reservation(self, self._entry(row))

    def _record(self, kind: str, dataset: str, mechanism: Mechanism, label: str | None,
                who: str | None, privacy_unit: str | None, ref: int | None = None,
                ref_hash: str | None = None, metadata: dict | None = None) -> tuple:
        """Check the cap and append a ``"spend"`` or ``"reserve"`` entry, atomically."""
        mechanism, text = _check_mechanism(mechanism)
        label, who = _check_opt_str("label", label), _check_who("who", who)
        unit, metadata = _check_unit(privacy_unit), check_metadata(metadata)
        with self._write() as cur:
            if ref is not None:
                r = cur.execute("SELECT kind, dataset, privacy_unit, hash FROM entries WHERE "
                                "seq=?", (ref,)).fetchone()
                if r is None or tuple(r[:3]) != ("reserve", dataset, unit) or (
                        ref_hash is not None and r[3] != ref_hash):
                    raise LedgerConflictError(
                        f"extends={ref!r}: no reservation with that seq on dataset "
                        f"{dataset!r} (privacy unit {unit!r}) in {self.path}")
            after = self._admit(cur, dataset, unit, mechanism,
                                "spend" if kind == "spend" else "reservation")
            return self._append(cur, kind, dataset, unit, mechanism=text, label=label,
                                payload=reported_payload(after.epsilon_spent, metadata),
                                who=who or _default_who(), ref=ref)

    def settle(self, reservation: int | Reservation, actual: Mechanism | None = None
               ) -> Entry:
        """Record what a reservation actually ran, as :meth:`Reservation.settle`: ``None``
        (default) = the plan in full; only an explicit ``compose([])`` = nothing ran."""
        seq = _check_seq("reservation", reservation.seq if isinstance(
            reservation, Reservation) else reservation)
        nothing_ran = False
        if actual is not None:
            actual, text = _check_mechanism(actual)
            if isinstance(actual, Composed) and not actual.parts:
                nothing_ran = True
        with self._write() as cur:
            r = cur.execute(f"SELECT {_COLUMNS} FROM entries WHERE seq=?", (seq,)).fetchone()
            if r is None or r[1] != "reserve":
                raise LedgerConflictError(f"no reservation with seq={seq!r} in {self.path}")
            if isinstance(reservation, Reservation) and reservation.entry.hash != r[11]:
                raise LedgerConflictError(
                    f"reservation {seq} was made in {reservation.ledger.path}, not in "
                    f"{self.path}: settle it on its own ledger (reservation.settle())")
            if cur.execute("SELECT 1 FROM entries WHERE kind='settle' AND ref=?",
                           (seq,)).fetchone():
                raise LedgerConflictError(f"reservation {seq} is already settled")
            plan = self._mech(r[4])
            if nothing_ran or actual is None:  # nothing / the plan in full
                actual, text = (None, None) if nothing_ran else (plan, r[4])
            if actual is not None and not _covered(actual, plan):
                raise LedgerConflictError(
                    f"the actual mechanism {actual!r} is not covered by reservation {seq}'s "
                    f"plan {plan!r}: settle with a sub-composition of the plan (e.g. fewer "
                    "steps) and spend anything beyond it separately"
                )
            row = self._append(cur, "settle", r[2], r[3], mechanism=text, label=r[6],
                               who=r[7], ref=seq,
                               payload=reported_payload(None, payload_metadata(r[5])))
        return self._entry(row)

    def pending(self, dataset: str, *, privacy_unit: str | None = None) -> list[Reservation]:
        """Reservations of ``dataset`` not yet settled (e.g. left by a killed process)."""
        dataset, unit = _check_name("dataset", dataset), _check_unit(privacy_unit)
        with self._read() as cur:
            rows = cur.execute(
                f"SELECT {_COLUMNS} FROM entries e WHERE kind='reserve' AND dataset=? AND "
                "privacy_unit=? AND NOT EXISTS (SELECT 1 FROM entries s WHERE s.kind='settle' "
                "AND s.ref=e.seq) ORDER BY seq",
                (dataset, unit),
            ).fetchall()
        return [Reservation(self, self._entry(r)) for r in rows]

    def spent(self, dataset: str, *, privacy_unit: str | None = None) -> Spent:
        """The certified total spent on ``dataset`` (see :class:`Spent`)."""
        unit = _check_unit(privacy_unit)
        with self._read() as cur:
            budget = self._get_budget(cur, dataset, unit)
            mechs, n, pending, floor = self._counted(cur, dataset, unit)
        return self._summary(budget, mechs, n, pending, floor)

    def mechanism(self, dataset: str, *, privacy_unit: str | None = None) -> Composed:
        """The composition of every counted release of ``dataset``, read under the
        budget's neighbouring relation (:attr:`Spent.neighbouring`), to re-account it with
        any accountant: ``ledger.mechanism("adult").epsilon(1e-6, "rdp")``. Under
        replace-one the add/remove releases are in their replace-one reading
        (:func:`~privlearn.accounting.as_replace_one`), which states replace-one for
        every part, so the result reads the same wherever it is evaluated."""
        unit = _check_unit(privacy_unit)
        with self._read() as cur:
            budget = self._get_budget(cur, dataset, unit)
            mechs, *_ = self._counted(cur, dataset, unit)
        relation = _relation(budget, mechs.distinct)
        return read_releases(budget, mechs, relation).composed

    def history(self, dataset: str | None = None, *, privacy_unit: str | None = None
                ) -> list[Entry]:
        """Entries in order (all of them, or those of one dataset)."""
        with self._read() as cur:
            if dataset is None:
                rows = cur.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq").fetchall()
            else:
                rows = cur.execute(
                    f"SELECT {_COLUMNS} FROM entries WHERE dataset=? AND privacy_unit=? "
                    "ORDER BY seq", (_check_name("dataset", dataset),
                                     _check_unit(privacy_unit))).fetchall()
        return [self._entry(r) for r in rows]

    def head(self) -> tuple[int, str]:
        """``(number of entries, hash of the last entry)``; store it elsewhere to detect a
        later rewrite of the whole file (``verify(expected_head=...)``)."""
        with self._read():
            assert self._seen is not None  # set by the integrity check
            return self._seen

    def verify(self, expected_head: tuple[int, str] | None = None) -> VerifyReport:
        """Check the whole file: every entry's hash, its link to the previous one, the
        sequence numbers, the head record (catches truncation), that every mechanism
        parses, that it extends the head this object last verified, and optionally an
        externally recorded ``expected_head``. Never raises for a tampered file (the
        report lists the problems); a passing check lifts the refusal of the other methods
        (see :class:`Ledger`)."""
        anchors = [h for h in (_check_head(expected_head), self._seen) if h is not None]
        try:
            with self._read(check=False) as cur:
                problems, n = self._chain_problems(cur, anchors, parse=True)
                if not problems:  # the snapshot verified: later calls compare with it
                    self._mark_verified(cur)
        except LedgerIntegrityError as exc:  # only a damaged file, which SQLite cannot read
            return VerifyReport(False, 0, exc.problems)
        return VerifyReport(not problems, n, tuple(problems))


