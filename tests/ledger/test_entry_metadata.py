"""Entry metadata: what a spender records beside the mechanism (a correlated-noise run's
strategy), hash-chained with the entry, repeated by the settle entry, listed by
``privlearn budget history``; entries of ledgers written before it (no payload, or a
payload without metadata) read as None."""

from __future__ import annotations

import json

import pytest
from _tampering import tamper
from click.testing import CliRunner

from privlearn.accounting import Gaussian
from privlearn.accounting.serialization import dumps
from privlearn.cli import cli
from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.ledger import Ledger

META = {"noise_strategy": "BandedToeplitz(bands=4, sha256=0123456789abcdef)"}


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "privacy.db", create=True)
    led.create_budget("toy", epsilon=10.0, delta=1e-5)
    return led


def test_metadata_is_recorded_repeated_by_the_settle_and_listed(ledger):
    ledger.spend("toy", Gaussian(5.0), label="plain")
    r = ledger.budget("toy").reserve(Gaussian(4.0), label="run", metadata=META)
    r.settle()
    ledger.budget("toy").spend(Gaussian(6.0), metadata={"note": "second"})
    spend, reserve, settle, other = ledger.history("toy")[1:]
    assert spend.metadata is None
    assert reserve.metadata == META and settle.metadata == META and settle.ref == reserve.seq
    assert other.metadata == {"note": "second"}
    assert ledger.verify()
    # the numbers do not change with it
    assert ledger.spent("toy").entries == 3

    run = CliRunner().invoke(cli, ["budget", "history", str(ledger.path), "--dataset", "toy"])
    assert run.exit_code == 0, run.output
    lines = run.output.splitlines()
    assert sum(f"noise_strategy={META['noise_strategy']}" in line for line in lines) == 2
    run = CliRunner().invoke(cli, ["budget", "history", str(ledger.path), "--json"])
    assert run.exit_code == 0, run.output
    listed = json.loads(run.output)
    assert [e["metadata"] for e in listed] == [None, None, META, META, {"note": "second"}]


def test_entries_written_before_metadata_read_as_none(ledger):
    """Rows as older versions wrote them: a spend without a payload (before payloads)
    and one whose payload holds only the epsilon spent (before metadata)."""
    with ledger._write() as cur:
        text = json.dumps({"epsilon_spent": 1.0})
        for payload in (None, text):
            ledger._append(
                cur,
                "spend",
                "toy",
                "record",
                payload=payload,
                who="old",
                mechanism=dumps(Gaussian(5.0)),
            )
    again = Ledger(ledger.path)
    assert again.verify()
    entries = again.history("toy")[1:]
    assert [e.metadata for e in entries] == [None, None]
    run = CliRunner().invoke(cli, ["budget", "history", str(ledger.path), "--json"])
    assert run.exit_code == 0, run.output
    assert [e["metadata"] for e in json.loads(run.output)] == [None, None, None]


@pytest.mark.parametrize(
    ("metadata", "error", "match"),
    [
        ("BandedToeplitz", ParameterTypeError, "metadata must be a mapping"),
        ({"noise_strategy": 3}, ParameterTypeError, r"metadata\['noise_strategy'\] must be a str"),
        ({"": "x"}, ParameterValueError, "non-empty"),
        ({"k": "two\nlines"}, ParameterValueError, "one line"),
    ],
)
def test_bad_metadata_is_refused_before_anything_is_recorded(ledger, metadata, error, match):
    with pytest.raises(error, match=match):
        ledger.spend("toy", Gaussian(5.0), metadata=metadata)
    assert len(ledger.history("toy")) == 1  # the budget entry only


def test_a_rewritten_strategy_name_breaks_the_hash_chain(ledger):
    ledger.budget("toy").reserve(Gaussian(4.0), metadata=META).settle()
    tamper(str(ledger.path), "UPDATE entries SET payload = replace(payload, '0123', '9999')")
    report = Ledger(ledger.path).verify()
    assert not report and len(report.problems) >= 2  # the reservation and its settle


def test_history_lines_cannot_be_forged_by_labels_or_metadata(ledger):
    """A bidirectional override in a label, or a metadata key/value holding the fields'
    separator, printed as is, made a ``budget history`` line read as other fields."""
    forged = {"noise_strategy": "x  who=admin", "a=b": "c", "k": "v"}
    ledger.spend("toy", Gaussian(5.0), label="run\u202e1nur", metadata=forged)
    run = CliRunner().invoke(cli, ["budget", "history", str(ledger.path), "--dataset", "toy"])
    assert run.exit_code == 0, run.output
    line = run.output.splitlines()[-1]
    assert "\u202e" not in line and "run\\u202e1nur" in line
    assert 'noise_strategy="x  who=admin"' in line and '"a=b"=c' in line and "  k=v" in line
