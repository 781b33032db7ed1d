"""``privlearn budget``: the persistent privacy ledger (:mod:`privlearn.ledger`)."""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
import unicodedata
from typing import Any

import click

from privlearn._validation import check_delta, check_positive
from privlearn.accounting import Mechanism
from privlearn.cli._app import ExitStatus, cli
from privlearn.cli._options import (
    _warn_delta,
    accountant_opt,
    build_mechanism,
    json_opt,
    json_option,
    mechanism_opt,
    none_if_inf,
    run_options,
    schedule_opts,
    stacked,
    unsupported,
)
from privlearn.errors import LedgerConflictError, ParameterValueError, UnsupportedMechanismError
from privlearn.ledger._busy import DEFAULT_TIMEOUT
from privlearn.ledger._records import _check_opt_str, _check_who, budget_conflict

__all__ = ["budget"]


#: Environment variable holding the HMAC key of a keyed ledger (when no ``--key-file``).
KEY_ENV = "PRIVLEARN_LEDGER_KEY"

_key_file_opt = click.option(
    "--key-file", type=click.Path(dir_okay=False), default=None,
    help="File holding the HMAC key of a keyed ledger (one trailing newline is stripped; "
    f"default: the {KEY_ENV} environment variable). Never pass the key itself on the "
    "command line (other users see it in `ps`).")



_timeout_opt = click.option(
    "--timeout", type=float, default=DEFAULT_TIMEOUT, show_default=True,
    metavar="SECONDS",
    help="Seconds to wait while another writer holds the ledger's write lock; past them "
    "the command gives up (status 2, nothing recorded). Must be > 0.")

#: The ledger every budget command opens: PATH, ``--key-file`` and ``--timeout``.
_ledger_file_opts = stacked(click.argument("path", type=click.Path(dir_okay=False)),
                            _key_file_opt, _timeout_opt)


def _check_timeout(timeout: float) -> float:
    return check_positive("--timeout", timeout,
                          hint="pass the seconds to wait for another writer, e.g. "
                          "--timeout 5 (default 60)")


def _ledger_key(key_file: str | None) -> tuple[bytes | None, str | None]:
    """The HMAC key from ``--key-file`` (one trailing newline stripped), else from
    :data:`KEY_ENV`, with where it came from; ``(None, None)`` without either."""
    if key_file is not None:
        try:
            with open(key_file, "rb") as f:
                key = f.read()
        except OSError as exc:
            raise ParameterValueError(
                f"--key-file: cannot read {key_file} ({exc.strerror or exc}); pass a "
                "readable file holding the key") from None
        key = key[:-2] if key.endswith(b"\r\n") else key[:-1] if key.endswith(b"\n") else key
        source = f"--key-file {key_file}"
    else:
        env = getattr(os, "environb", None)
        key = env.get(KEY_ENV.encode()) if env is not None else (
            None if os.environ.get(KEY_ENV) is None else os.fsencode(os.environ[KEY_ENV]))
        if key is None:
            return None, None
        source = f"the {KEY_ENV} environment variable"
    if not key:
        raise ParameterValueError(
            f"{'--key-file' if key_file is not None else KEY_ENV}: the HMAC key from "
            f"{source} is empty; put the ledger's secret key there"
            + ("" if key_file is not None else f" or unset {KEY_ENV}"))
    return key, source


def _open_ledger(path: str, key_file: str | None = None, *, create: bool = False,
                 check_key: bool = True, timeout: float = DEFAULT_TIMEOUT):
    """The ledger at ``path``, opened with the key of ``--key-file`` or
    :data:`KEY_ENV`; its errors (none there, not a ledger, tampered, a key missing or not
    expected) are typed and reported by :class:`_OneLineErrors` in the shell's words.
    With ``check_key``, a key that does not verify the ledger's hash chain is refused
    here (status 4) with a message that names the key as a likely cause. ``timeout``
    (``--timeout``) is the seconds each request waits for another writer."""
    from privlearn.errors import LedgerIntegrityError
    from privlearn.ledger import Ledger

    timeout = _check_timeout(timeout)
    key, source = _ledger_key(key_file)
    try:
        led = Ledger(path, create=create, key=key, timeout=timeout)
    except ParameterValueError:  # the only one here: a key missing or not expected
        if key is None:
            raise ParameterValueError(
                f"ledger {path} was created with an HMAC key: pass the file holding it with "
                f"--key-file PATH or set the {KEY_ENV} environment variable (never the key "
                "itself on the command line)") from None
        raise ParameterValueError(
            f"ledger {path} was created without an HMAC key, but a key was given by "
            f"{source}: "
            + ("drop --key-file" if key_file is not None else f"unset {KEY_ENV}")
            + " (unless the ledger was created with this key: then the file was rewritten "
            "without it, i.e. tampered with, which dropping the key would hide: restore "
            "it from a backup)") from None
    if key is not None and check_key:
        report = led.verify()
        if not report.ok:
            raise LedgerIntegrityError(
                f"ledger {path} fails its integrity check with the key from {source}: "
                "the key is not the one the ledger was created with, or the file was "
                "tampered with (" + "; ".join(report.problems[:3])
                + ("; ..." if len(report.problems) > 3 else "") + ")",
                report.problems)
    return led


def _spent_json(s) -> dict[str, Any]:
    return {
        "dataset": s.dataset,
        "privacy_unit": s.privacy_unit,
        "epsilon_spent": none_if_inf(s.epsilon_spent),
        "epsilon_lower": none_if_inf(s.epsilon_lower),
        "epsilon_budget": s.epsilon_budget,
        "epsilon_remaining": s.epsilon_remaining,
        "delta": s.delta,
        "entries": s.entries,
        "pending": s.pending,
        "accountant": s.accountant,
        "adaptive": s.adaptive,
        "adaptive_epsilon": none_if_inf(s.adaptive_epsilon),
        "adaptive_order": s.adaptive_order,
        "neighbouring": None if s.neighbouring is None else s.neighbouring.value,
    }


def _relation(r) -> str:
    """A budget's neighbouring relation as the budget commands print it."""
    return UNSET_RELATION if r is None else r.value


#: What ``budget init`` prints in place of the relation of a budget created without one.
UNSET_RELATION = "neighbouring relation to be fixed by the first release"

#: The lines ``budget init`` adds for a budget created without ``--neighbouring``.
UNSET_RELATION_NOTE = textwrap.fill(
    "The neighbouring relation says which two datasets differ by one record: add_remove "
    "(a record added or removed) or replace_one (a record replaced, as with fixed-size "
    "batches). The first release recorded fixes it; to fix it when a budget is created, "
    "pass --neighbouring add_remove or --neighbouring replace_one to budget init (a "
    "budget never changes afterwards).",
    width=88, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False,
    break_long_words=False)


def _print_spent(s) -> None:
    click.echo(str(s))


@cli.group()
def budget() -> None:
    """A persistent privacy ledger: one budget per dataset, tight composition of every
    release, hash-chained entries.

    \b
    A first ledger:
      privlearn budget init privacy.db --dataset adult --epsilon 3 --delta 1e-6
      privlearn budget spend privacy.db --dataset adult --noise-multiplier 1.1 \\
          --sampling-rate 0.01 --steps 1000 --label "dp-sgd run 1"
      privlearn budget show privacy.db --dataset adult

    A command waits up to 60 s while another process writes the ledger, then gives up
    (status 2, nothing recorded); --timeout SECONDS changes the wait.

    `privlearn budget COMMAND --help` describes each command and its options; from
    Python, privlearn.ledger.Ledger records the releases of estimators and of DP-SGD
    runs (help(privlearn.ledger)).
    """


def _check_names(dataset: str | None, privacy_unit: str | None) -> None:
    """Refuse an empty --dataset or --privacy-unit in the shell's words (the ledger's
    own refusal names its Python parameters)."""
    for option, name in (("--dataset", dataset), ("--privacy-unit", privacy_unit)):
        if name is not None and not name.strip():
            raise ParameterValueError(f"{option} must be a non-empty name, got {name!r}")


_ledger_dataset_opt = click.option("--dataset", required=True, help="Dataset name.")
_unit_opt = click.option("--privacy-unit", default=None,
                         help="Privacy unit of the budget (default: record).")


@budget.command(name="init")
@_ledger_file_opts
@_ledger_dataset_opt
@click.option("--epsilon", type=float, required=True, help="Budget epsilon (> 0).")
@click.option("--delta", type=float, required=True, help="Budget delta in [0, 1).")
@_unit_opt
@accountant_opt
@click.option("--adaptive", is_flag=True,
              help="Enforce the cap with a Renyi filter (valid under fully adaptive choice "
              "of releases; admits less than the tight total).")
@click.option("--neighbouring", type=click.Choice(["add_remove", "replace_one"]),
              default=None,
              help="Neighbouring relation of the cap: which two datasets count as "
              "differing in one record, add_remove (one record added or removed) or "
              "replace_one (one record replaced). Default: fixed by the first release "
              "recorded. replace_one also takes add/remove releases, at their replace-one "
              "cost.")
@click.option("--exist-ok", is_flag=True,
              help="A budget DATASET already has with these same settings is not an error "
              "(a script that runs more than once); other settings still are.")
def budget_init(path: str, key_file: str | None, timeout: float, dataset: str,
                epsilon: float, delta: float,
                privacy_unit: str | None, accountant: str, adaptive: bool,
                neighbouring: str | None, exist_ok: bool) -> None:
    """Create the ledger at PATH (if needed) and set DATASET's budget."""
    _check_names(dataset, privacy_unit)  # before the file is created: a refused init leaves none
    epsilon = check_positive("--epsilon", epsilon, hint="e.g. --epsilon 1")
    delta = check_delta("--delta", delta)
    if adaptive and delta == 0.0:
        raise ParameterValueError("--delta must be in (0, 1) with --adaptive (the Renyi "
                                  "filter gives no delta=0 guarantee), got 0; e.g. 1e-6")
    led = _open_ledger(path, key_file, create=True, timeout=timeout)
    try:
        b = led.create_budget(dataset, epsilon, delta, privacy_unit=privacy_unit,
                              accountant=accountant, adaptive=adaptive,
                              neighbouring=neighbouring, exist_ok=exist_ok)
    except LedgerConflictError as exc:  # what to do, in the shell's words
        if exc.existing is None:
            raise
        raise LedgerConflictError(budget_conflict(path, exc.existing, exc.asked, exist_ok,
                                                  shell=True)) from None
    click.echo(f"budget for {b.dataset} ({b.privacy_unit}, {_relation(b.neighbouring)}): "
               f"epsilon {b.epsilon:g}, delta {b.delta:g} "
               f"({'adaptive, Renyi filter' if b.adaptive else b.accountant})")
    if b.neighbouring is None:
        click.echo(UNSET_RELATION_NOTE)


def _spend_noise_multiplier(kind: str, noise_multiplier: float | None,
                            pure_epsilon: float | None) -> float:
    """The noise multiplier of ``budget spend``: ``--noise-multiplier``, or for a Laplace
    release ``--epsilon E``: the Laplace mechanism of scale ``b`` (in units of the L1
    sensitivity) is ``1/b``-DP (Dwork, McSherry, Nissim & Smith 2006, Proposition 1), so
    ``b = 1/E``, rounded down to the largest float whose ``1/b`` is at least ``E`` (the
    ledger never records more noise than was added)."""
    if noise_multiplier is not None and pure_epsilon is not None:
        raise ParameterValueError(
            f"give one of --noise-multiplier and --epsilon, got --noise-multiplier "
            f"{noise_multiplier:g} and --epsilon {pure_epsilon:g}; with --mechanism laplace "
            "--epsilon E is --noise-multiplier 1/E")
    if pure_epsilon is None:
        if noise_multiplier is None:
            raise click.UsageError(
                "Missing option '--noise-multiplier': the noise standard deviation "
                "(gaussian) or scale (laplace) of the release over its sensitivity; a "
                "Laplace release at epsilon E is --mechanism laplace --epsilon E")
        return check_positive("--noise-multiplier", noise_multiplier)
    if kind != "laplace":
        raise ParameterValueError(
            f"--epsilon {pure_epsilon:g} describes a pure-DP Laplace release (--mechanism "
            f"laplace), got --mechanism {kind}; a Gaussian release is recorded by its "
            "--noise-multiplier: `privlearn calibrate --target-epsilon E --delta D` prints "
            "the one that is (E, D)-DP")
    eps = check_positive("--epsilon", pure_epsilon,
                         hint="pass the epsilon of the Laplace release, e.g. --epsilon 0.5")
    b = 1.0 / eps
    while 1.0 / b < eps:  # conservative: never a larger scale than 1/eps
        b = math.nextafter(b, 0.0)
    return b


@budget.command(name="spend")
@_ledger_file_opts
@_ledger_dataset_opt
@mechanism_opt
@click.option("--noise-multiplier", type=float, default=None,
              help="Noise multiplier (> 0). Required, unless --epsilon describes a Laplace "
              "release.")
@click.option("--epsilon", "pure_epsilon", type=float, default=None,
              help="With --mechanism laplace, the epsilon of each step instead of its noise "
              "multiplier (a Laplace release at epsilon E, noise scale = L1 sensitivity / "
              "E, is --noise-multiplier 1/E).")
@schedule_opts
@click.option("--label", default=None, help="What was released.")
@click.option("--who", default=None, help="Who spent it (default: user@host).")
@_unit_opt
@json_opt
def budget_spend(path: str, key_file: str | None, timeout: float, dataset: str,
                 mechanism: str,
                 noise_multiplier: float | None, pure_epsilon: float | None,
                 sampling_rate: float | None, sampling: str, steps: int | None,
                 batch_size: int | None, dataset_size: int | None, epochs: int | None,
                 label: str | None, who: str | None, privacy_unit: str | None,
                 as_json: bool) -> None:
    """Record a release on DATASET; refused (status 3, nothing recorded) if it would
    exceed the budget.

    Describe the release by --sampling-rate and --steps, or a make_private run by
    --batch-size, --dataset-size and --epochs (as privlearn epsilon does).
    """
    _check_names(dataset, privacy_unit)
    label, who = _check_opt_str("--label", label), _check_who("--who", who)
    kind, rate, samp, t, note = run_options(mechanism, sampling, sampling_rate, steps,
                                            batch_size, dataset_size, epochs,
                                            epoch_form=True)
    nm = _spend_noise_multiplier(kind, noise_multiplier, pure_epsilon)
    mech = build_mechanism(kind, nm, rate, samp, t)
    led = _open_ledger(path, key_file, timeout=timeout)
    _warn_delta(led.budget_info(dataset, privacy_unit=privacy_unit).delta, dataset_size,
                name="the budget's --delta")
    try:
        entry = led.spend(dataset, mech, label=label, who=who, privacy_unit=privacy_unit)
    except UnsupportedMechanismError as e:  # the budget's accountant, set by budget init
        acc = led.spent(dataset, privacy_unit=privacy_unit).accountant
        refusal = unsupported(f"the budget of dataset {dataset!r}, accounted with {acc},",
                              acc, e, kind, nm, rate, samp, t)
        raise UnsupportedMechanismError(f"{refusal}; nothing was recorded") from e
    s = led.spent(dataset, privacy_unit=privacy_unit)
    if as_json:
        click.echo(json.dumps({"seq": entry.seq, "hash": entry.hash, **_spent_json(s)}))
    else:
        click.echo(f"recorded entry {entry.seq}")
        if note:
            click.echo(f"schedule: {note}")
        _print_spent(s)


@budget.command(name="show")
@_ledger_file_opts
@click.option("--dataset", default=None,
              help="Dataset name (default: every budget of the ledger).")
@_unit_opt
@json_option("Print one JSON object (without --dataset: a JSON list, one object per "
             "budget).")
def budget_show(path: str, key_file: str | None, timeout: float, dataset: str | None,
                privacy_unit: str | None,
                as_json: bool) -> None:
    """What has been spent on DATASET (tight composition, certified bounds); without
    --dataset, on every budget of the ledger (with --json, a list of objects)."""
    _check_names(dataset, privacy_unit)
    led = _open_ledger(path, key_file, timeout=timeout)
    if dataset is not None:
        s = led.spent(dataset, privacy_unit=privacy_unit)
        if as_json:
            click.echo(json.dumps(_spent_json(s)))
        else:
            _print_spent(s)
        return
    spent = [led.spent(b.dataset, privacy_unit=b.privacy_unit) for b in led.budgets()
             if privacy_unit is None or b.privacy_unit == privacy_unit]
    if as_json:
        click.echo(json.dumps([_spent_json(s) for s in spent]))
        return
    if not spent:
        click.echo(f"no budget{'' if privacy_unit is None else ' per ' + privacy_unit} "
                   f"in {path}; create one with `privlearn budget init {path} --dataset "
                   "NAME --epsilon E --delta D"
                   + ("" if privacy_unit is None else f" --privacy-unit {privacy_unit}") + "`")
    for s in spent:
        _print_spent(s)


@budget.command(name="history")
@_ledger_file_opts
@click.option("--dataset", default=None,
              help="Dataset name (default: the entries of every budget, each line naming "
                   "its dataset).")
@_unit_opt
@json_option("Print one JSON list, one object per entry (seq, kind, dataset, "
             "privacy_unit, time, label, who, ref, hash, mechanism, metadata).")
def budget_history(path: str, key_file: str | None, timeout: float, dataset: str | None,
                   privacy_unit: str | None,
                   as_json: bool) -> None:
    """Every entry of DATASET, oldest first; without --dataset, every entry of the
    ledger."""
    from privlearn.accounting.serialization import mechanism_to_dict

    _check_names(dataset, privacy_unit)
    led = _open_ledger(path, key_file, timeout=timeout)
    if dataset is not None:
        led.budget_info(dataset, privacy_unit=privacy_unit)
        entries = led.history(dataset, privacy_unit=privacy_unit)
    else:
        entries = [e for e in led.history()
                   if privacy_unit is None or e.privacy_unit == privacy_unit]
    if as_json:
        click.echo(json.dumps([
            {"seq": e.seq, "kind": e.kind, "dataset": e.dataset,
             "privacy_unit": e.privacy_unit, "time": e.time, "label": e.label, "who": e.who,
             "ref": e.ref, "hash": e.hash,
             "mechanism": None if e.mechanism is None else mechanism_to_dict(e.mechanism),
             "metadata": e.metadata}
            for e in entries
        ]))
        return
    for e in entries:
        what = "" if e.mechanism is None else f"  {_describe_mechanism(e.mechanism)}"
        ref = f" (reservation {e.ref})" if e.ref is not None else ""
        where = "" if dataset is not None else f"{_escaped(e.dataset)}/{e.privacy_unit}  "
        meta = "".join(f"  {_meta_field(k, key=True)}={_meta_field(v)}"
                       for k, v in (e.metadata or {}).items())
        click.echo(f"{e.seq:>6}  {e.time}  {e.kind:<7} {where}{_escaped(e.label) or '-'}  "
                   f"[{_escaped(e.who) or '-'}]{ref}{what}{meta}")


def _escaped(text: str | None) -> str | None:
    """``text`` with its line breaks, control and format characters escaped (``\\n``,
    ``\\u202e``), so that an entry stays on one line (labels written before the ledger
    refused them) and a bidirectional override cannot make it read as other fields."""
    if text is None:
        return None
    return "".join(c.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c for c in text)


def _meta_field(text: str, key: bool = False) -> str:
    """A metadata key or value for ``budget history``: escaped, and quoted (JSON) where its
    contents could read as another field: a key holding a space, ``=`` or a quote; a value
    holding two spaces in a row (the fields' separator), a quote, or edge whitespace."""
    text = _escaped(text)
    forged = (any(c.isspace() or c in '="' for c in text) if key else
              '"' in text or re.search(r"\s\s", text) is not None or text != text.strip())
    return json.dumps(text) if forged else text


def _describe_mechanism(m: Mechanism) -> str:
    """A short human-readable description of a mechanism (for ``budget history``)."""
    from privlearn.accounting import Composed, Subsampled

    if isinstance(m, Composed):
        return " + ".join(
            (f"{k} x " if k > 1 else "") + _describe_mechanism(mm) for mm, k in m.parts
        ) or "nothing"
    if isinstance(m, Subsampled):
        return (f"{_describe_mechanism(m.base)} subsampled q={m.rate:g} ({m.scheme.value}, "
                f"{m.neighbouring.value})")
    fields = getattr(m, "__dataclass_fields__", {})
    args = ", ".join(f"{getattr(m, f):g}" if isinstance(getattr(m, f), float)
                     else str(getattr(m, f)) for f in fields if f != "rdp_function")
    return f"{type(m).__name__}({args})"


@budget.command(name="verify")
@_ledger_file_opts
@click.option("--expect-head", default=None, metavar="COUNT:HASH",
              help="A head printed earlier by `verify` (kept outside the file): also fail "
              "unless the ledger extends it (detects truncation with the head rewritten).")
def budget_verify(path: str, key_file: str | None, timeout: float,
                  expect_head: str | None) -> None:
    """Check the hash chain of the ledger at PATH: status 0 when intact, 4 (listing the
    problems) when an entry was edited, removed or the ledger truncated. Every other
    budget command also refuses a ledger that fails this check (status 4)."""
    expected = None
    if expect_head is not None:
        # ASCII digits only (str.isdigit also takes e.g. superscripts, which int refuses)
        head = re.fullmatch(r"([0-9]+):([0-9a-fA-F]{64})", expect_head.strip())
        if head is None:
            raise click.BadParameter(f"must be COUNT:HASH (64 hex digits), got {expect_head!r}",
                                     param_hint="'--expect-head'")
        expected = (int(head[1]), head[2].lower())
    led = _open_ledger(path, key_file, check_key=False, timeout=timeout)
    report = led.verify(expected_head=expected)
    if report.ok:
        n, h = led.head()
        click.echo(f"ok: {report.entries} entries, hash chain intact; head {n}:{h}")
        return
    for p in report.problems:
        click.echo(f"TAMPERED: {p}", err=True)
    _, source = _ledger_key(key_file)
    if source is not None:
        click.echo(f"(or the key from {source} is not the one the ledger was created with)",
                   err=True)
    raise click.exceptions.Exit(ExitStatus.LEDGER_TAMPERED)


