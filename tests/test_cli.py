"""Command line: values equal the Python API's, bad input is one line + exit status 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from privlearn import __version__
from privlearn.accounting import Gaussian, Laplace, compose, subsample
from privlearn.cli import cli


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, args: list[str]):
    return runner.invoke(cli, args, catch_exceptions=False)


# -- epsilon ------------------------------------------------------------------------------
def test_epsilon_json_gaussian_matches_api(runner: CliRunner) -> None:
    r = invoke(
        runner,
        ["epsilon", "--noise-multiplier", "1.1", "--steps", "10", "--delta", "1e-5", "--json"],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {
        "epsilon",
        "epsilon_lower",
        "delta",
        "accountant",
        "mechanism",
        "noise_multiplier",
        "sampling_rate",
        "steps",
    } <= set(out)
    bound = compose(Gaussian(1.1), steps=10).epsilon_bounds(1e-5, "pld")
    assert out["epsilon"] == bound.upper
    assert out["epsilon_lower"] == bound.lower
    assert out["delta"] == 1e-5
    assert out["accountant"] == "pld"
    assert (out["mechanism"], out["noise_multiplier"], out["steps"]) == ("gaussian", 1.1, 10)
    assert out["sampling_rate"] is None


def test_epsilon_plain_prints_number(runner: CliRunner) -> None:
    r = invoke(
        runner,
        ["epsilon", "--noise-multiplier", "2", "--delta", "1e-6", "--accountant", "analytic"],
    )
    assert r.exit_code == 0
    assert float(r.stdout) == Gaussian(2.0).epsilon(1e-6, "analytic")


def test_epsilon_subsampled_rdp_matches_api(runner: CliRunner) -> None:
    r = invoke(
        runner,
        [
            "epsilon",
            "--noise-multiplier",
            "1.0",
            "--sampling-rate",
            "0.01",
            "--steps",
            "100",
            "--delta",
            "1e-5",
            "--accountant",
            "rdp",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    expected = compose(subsample(Gaussian(1.0), 0.01), steps=100).epsilon(1e-5, "rdp")
    assert out["epsilon"] == expected
    assert out["accountant"] == "rdp"
    assert (out["sampling_rate"], out["sampling"]) == (0.01, "poisson")


def test_epsilon_laplace_pure(runner: CliRunner) -> None:
    r = invoke(
        runner,
        [
            "epsilon",
            "--mechanism",
            "laplace",
            "--noise-multiplier",
            "4",
            "--steps",
            "3",
            "--delta",
            "0",
            "--accountant",
            "rdp",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["epsilon"] == compose(Laplace(4.0), steps=3).epsilon(0.0, "rdp")
    assert out["epsilon"] >= 0.75  # never below the exact pure-DP epsilon 3/4


# -- calibrate --------------------------------------------------------------------------
def test_calibrate_meets_target(runner: CliRunner) -> None:
    r = invoke(
        runner,
        ["calibrate", "--target-epsilon", "1.0", "--delta", "1e-5", "--steps", "50", "--json"],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    sigma = out["noise_multiplier"]
    m = compose(Gaussian(sigma), steps=50)
    assert m.epsilon(1e-5, "analytic") <= 1.0
    assert out["epsilon"] == m.epsilon(1e-5, "pld") <= 1.0
    # smallest: 1e-5 less noise misses the target
    assert compose(Gaussian(sigma * (1 - 1e-5)), steps=50).epsilon(1e-5, "analytic") > 1.0


def test_calibrate_plain(runner: CliRunner) -> None:
    r = invoke(runner, ["calibrate", "--target-epsilon", "2", "--delta", "1e-6"])
    assert r.exit_code == 0
    sigma = float(r.stdout)
    assert Gaussian(sigma).epsilon(1e-6, "analytic") <= 2.0


# -- bad input ---------------------------------------------------------------------------
BAD = [
    (["epsilon", "--noise-multiplier", "-1", "--delta", "1e-5"], "--noise-multiplier"),
    (["epsilon", "--noise-multiplier", "abc", "--delta", "1e-5"], "--noise-multiplier"),
    (["epsilon", "--noise-multiplier", "1", "--delta", "1"], "--delta"),
    (["epsilon", "--noise-multiplier", "1", "--delta", "-0.1"], "--delta"),
    (
        ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--sampling-rate", "0"],
        "--sampling-rate",
    ),
    (
        ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--sampling-rate", "1.5"],
        "--sampling-rate",
    ),
    (["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--steps", "2.5"], "--steps"),
    (["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--steps", "0"], "--steps"),
    (
        ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--accountant", "foo"],
        "--accountant",
    ),
    (
        ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--mechanism", "foo"],
        "--mechanism",
    ),
    (["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--sampling", "foo"], "--sampling"),
    (["epsilon", "--delta", "1e-5"], "--noise-multiplier"),
    (
        [
            "epsilon",
            "--noise-multiplier",
            "1",
            "--delta",
            "1e-5",
            "--sampling-rate",
            "0.1",
            "--accountant",
            "analytic",
        ],
        "analytic",
    ),
    (["calibrate", "--target-epsilon", "-1", "--delta", "1e-5"], "--target-epsilon"),
    (["calibrate", "--target-epsilon", "1", "--delta", "2"], "--delta"),
    (["nosuchcommand"], "nosuchcommand"),
]


@pytest.mark.parametrize(("args", "names"), BAD)
def test_bad_input_one_line_exit_2(runner: CliRunner, args: list[str], names: str) -> None:
    r = runner.invoke(cli, args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    assert names in lines[0]
    assert "Traceback" not in r.output
    assert r.stdout == ""


def test_bad_value_message_has_range_and_value(runner: CliRunner) -> None:
    r = runner.invoke(
        cli, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--sampling-rate", "1.5"]
    )
    # (privlearn._validation appends what to try after the value)
    assert r.stderr.strip().startswith("error: --sampling-rate must be in (0, 1], got 1.5")


def test_unsupported_calibration_exits_2(runner: CliRunner) -> None:
    """An accountant that cannot evaluate the mechanism: one line, exit 2."""
    r = runner.invoke(
        cli,
        [
            "calibrate",
            "--target-epsilon",
            "1",
            "--delta",
            "1e-5",
            "--sampling-rate",
            "0.1",
            "--accountant",
            "analytic",
        ],
    )
    assert r.exit_code == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: ")
    assert "analytic" in r.stderr


# -- version, demo, reproduce ----------------------------------------------------------
def test_version(runner: CliRunner) -> None:
    r = invoke(runner, ["--version"])
    assert r.exit_code == 0
    assert __version__ in r.stdout


def test_demo_prints_table_fast(runner: CliRunner) -> None:
    t0 = time.process_time()  # CPU time: robust to a loaded shared machine
    r = invoke(runner, ["demo", "--no-experiment"])
    elapsed = time.process_time() - t0
    assert r.exit_code == 0, r.output
    for name in (
        "NoisyGD",
        "NoisySGD",
        "PATE (Gaussian)",
        "Private kNN",
        "PATE / NoisyGD (Laplace)",
        "NoisySGD / Private kNN (Laplace)",
    ):
        assert name in r.stdout
    for printed in ("2.06774", "0.271056", "10.9972", "10.8503", "0.256933"):
        assert printed in r.stdout
    assert elapsed < 5.0


def test_demo_table_values() -> None:
    from privlearn.demo import SCENARIOS, accounting_table

    rows = accounting_table()
    assert len(rows) == len(SCENARIOS) == 6
    for row, sc in zip(rows, SCENARIOS, strict=True):
        assert row.seed_epsilon == sc.seed_epsilon
        assert row.rdp == sc.mechanism.epsilon(1e-6, "rdp")
        if row.pld_upper is not None:
            assert row.pld_upper == sc.mechanism.epsilon(1e-6, "pld")
            assert row.pld_lower is None or row.pld_lower <= row.pld_upper


def test_reproduce_unknown_name(runner: CliRunner) -> None:
    pytest.importorskip("privlearn.experiments")
    r = runner.invoke(cli, ["reproduce", "no-such-experiment"])
    assert r.exit_code == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "NAME" in r.stderr


# -- the installed console script and python -m ----------------------------------------
def test_console_script_subprocess() -> None:
    exe = shutil.which("privlearn")
    if exe is None:
        pytest.skip("privlearn console script not installed")
    p = subprocess.run(
        [exe, "epsilon", "--noise-multiplier", "2", "--steps", "4", "--delta", "1e-6", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["epsilon"] == compose(Gaussian(2.0), steps=4).epsilon(1e-6, "pld")
    bad = subprocess.run(
        [exe, "epsilon", "--noise-multiplier", "-2", "--delta", "1e-6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr.strip() == "error: --noise-multiplier must be in (0, inf) and finite, got -2.0"
    )


def test_python_dash_m() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "privlearn", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0
    assert __version__ in p.stdout


def test_reproduce_forwards_options(runner: CliRunner, monkeypatch, tmp_path) -> None:
    experiments = pytest.importorskip("privlearn.experiments")
    calls = []

    class Result:
        paths = [tmp_path / "x.csv"]

    def fake(name, **kwargs):
        calls.append((name, kwargs))
        return Result()

    monkeypatch.setattr(experiments, "run_experiment", fake)
    name = sorted(experiments.EXPERIMENTS)[0]
    r = invoke(runner, ["reproduce", name, "--out", str(tmp_path), "--reps", "3", "--seed", "7"])
    assert r.exit_code == 0, r.output
    assert calls == [(name, {"out_dir": str(tmp_path), "reps": 3, "seed": 7})]
    assert f"wrote {tmp_path / 'x.csv'}" in r.stdout
    r = invoke(runner, ["reproduce", name])
    assert calls[-1] == (name, {})
