"""Command line: values equal the Python API's, bad input is one line + exit status 2."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

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


def _json(runner: CliRunner, args: list[str]) -> dict:
    """The one JSON object a command that succeeds prints (``args`` ending in --json)."""
    r = invoke(runner, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _error_line(runner: CliRunner, args: list[str], **kwargs) -> str:
    """The one ``error: ...`` line of a command refused as bad input (status 2, nothing
    on stdout, no traceback)."""
    r = runner.invoke(cli, args, **kwargs)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    return lines[0]


# -- epsilon ------------------------------------------------------------------------------
def test_epsilon_json_gaussian_matches_api(runner: CliRunner) -> None:
    out = _json(runner, ["epsilon", "--noise-multiplier", "1.1", "--steps", "10", "--delta",
                         "1e-5", "--json"])
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


def _labelled(stdout: str) -> dict[str, str]:
    """``name: value (explanation)`` lines of the plain output, as name -> value."""
    out = {}
    for line in stdout.strip().splitlines():
        name, _, rest = line.partition(": ")
        out[name] = rest.split(" (")[0]
    return out


def test_epsilon_plain_labels_each_number(runner: CliRunner) -> None:
    r = invoke(
        runner,
        ["epsilon", "--noise-multiplier", "2", "--delta", "1e-6", "--accountant", "analytic"],
    )
    assert r.exit_code == 0
    out = _labelled(r.stdout)
    assert float(out["epsilon"]) == Gaussian(2.0).epsilon(1e-6, "analytic")
    assert "certified upper bound, analytic accountant" in r.stdout
    assert float(out["delta"]) == 1e-6
    assert out["mechanism"].startswith("gaussian, noise multiplier 2, no subsampling, 1 step")


def test_epsilon_plain_pld_prints_lower_bound(runner: CliRunner) -> None:
    r = invoke(runner, ["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.01",
                        "--steps", "100", "--delta", "1e-5"])
    assert r.exit_code == 0, r.output
    out = _labelled(r.stdout)
    b = compose(subsample(Gaussian(1.0), 0.01), steps=100).epsilon_bounds(1e-5, "pld")
    assert float(out["epsilon"]) == b.upper
    assert float(out["epsilon lower bound"]) == b.lower


def test_epsilon_subsampled_rdp_matches_api(runner: CliRunner) -> None:
    out = _json(runner, ["epsilon", "--noise-multiplier", "1.0", "--sampling-rate", "0.01",
                         "--steps", "100", "--delta", "1e-5", "--accountant", "rdp", "--json"])
    expected = compose(subsample(Gaussian(1.0), 0.01), steps=100).epsilon(1e-5, "rdp")
    assert out["epsilon"] == expected
    assert out["accountant"] == "rdp"
    assert (out["sampling_rate"], out["sampling"]) == (0.01, "poisson")


def test_epsilon_laplace_pure(runner: CliRunner) -> None:
    out = _json(runner, ["epsilon", "--mechanism", "laplace", "--noise-multiplier", "4",
                         "--steps", "3", "--delta", "0", "--accountant", "rdp", "--json"])
    assert out["epsilon"] == compose(Laplace(4.0), steps=3).epsilon(0.0, "rdp")
    assert out["epsilon"] >= 0.75  # never below the exact pure-DP epsilon 3/4


# -- calibrate --------------------------------------------------------------------------
def test_calibrate_meets_target(runner: CliRunner) -> None:
    out = _json(runner, ["calibrate", "--target-epsilon", "1.0", "--delta", "1e-5", "--steps",
                         "50", "--json"])
    sigma = out["noise_multiplier"]
    m = compose(Gaussian(sigma), steps=50)
    assert m.epsilon(1e-5, "analytic") <= 1.0
    assert out["epsilon"] == m.epsilon(1e-5, "pld") <= 1.0
    # smallest: 1e-5 less noise misses the target
    assert compose(Gaussian(sigma * (1 - 1e-5)), steps=50).epsilon(1e-5, "analytic") > 1.0


def test_calibrate_json_reports_the_lower_bound_as_epsilon_does(runner: CliRunner) -> None:
    # calibrate --json and epsilon --json name the same quantities with the same keys:
    # calibrate printed no certified lower bound (epsilon_lower) at the noise it found
    cal = _json(runner, ["calibrate", "--target-epsilon", "1.0", "--delta", "1e-5", "--steps",
                         "20", "--json"])
    sigma = cal["noise_multiplier"]
    eps = _json(runner, ["epsilon", "--noise-multiplier", repr(sigma), "--steps", "20",
                         "--delta", "1e-5", "--json"])
    shared = set(eps) - {"noise_multiplier"}
    assert shared <= set(cal)
    assert cal["epsilon_lower"] == eps["epsilon_lower"]
    assert cal["accountant"] == eps["accountant"]
    # the lower bound is one: the closed form of 20 Gaussians is one Gaussian of noise
    # sigma / sqrt(20) (Balle & Wang 2018), and its exact epsilon is not below it
    exact = Gaussian(sigma / math.sqrt(20)).epsilon(1e-5, "analytic")
    assert cal["epsilon_lower"] <= exact * (1 + 1e-9) <= cal["epsilon"] * (1 + 1e-9)


def test_calibrate_plain(runner: CliRunner) -> None:
    r = invoke(runner, ["calibrate", "--target-epsilon", "2", "--delta", "1e-6"])
    assert r.exit_code == 0
    out = _labelled(r.stdout)
    sigma = float(out["noise multiplier"])
    assert Gaussian(sigma).epsilon(1e-6, "analytic") <= 2.0
    assert float(out["epsilon"]) == Gaussian(sigma).epsilon(1e-6, "pld") <= 2.0


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
    assert names in _error_line(runner, args)


@pytest.mark.parametrize("command", [
    ["epsilon", "--noise-multiplier", "1"], ["calibrate", "--target-epsilon", "1"]])
@pytest.mark.parametrize("scheme", ["fixed", "poisson"])
@pytest.mark.parametrize("run", [[], ["--steps", "100"]])
def test_sampling_without_a_rate_is_a_usage_error(runner: CliRunner, command: list[str],
                                                  scheme: str, run: list[str]) -> None:
    """``--sampling`` without a rate (neither --sampling-rate nor --batch-size,
    --dataset-size and --epochs) describes no subsampling: refused (status 2) naming the
    options that give the rate, not silently accounted without subsampling."""
    line = _error_line(runner, [*command, "--delta", "1e-5", "--sampling", scheme, *run])
    assert line.startswith(f"error: --sampling {scheme} needs --sampling-rate")
    assert "--batch-size, --dataset-size and --epochs" in line


def test_sampling_with_the_epoch_form_is_accounted_subsampled(runner: CliRunner) -> None:
    """The epoch form gives the rate: ``--sampling fixed`` is then the fixed-size
    subsampled Gaussian at B/N for E x round(N/B) steps."""
    out = _json(runner, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5",
                         "--sampling", "fixed", "--batch-size", "10", "--dataset-size",
                         "1000", "--epochs", "1", "--json"])
    want = compose(subsample(Gaussian(1.0), 0.01, scheme="fixed"), steps=100)
    assert (out["sampling"], out["sampling_rate"], out["steps"]) == ("fixed", 0.01, 100)
    assert out["epsilon"] == want.epsilon_bounds(1e-5, "pld").upper


@pytest.mark.parametrize("name", ["adult", "correlated-noise-adult-bert"])
@pytest.mark.parametrize("seed", [str(2**32), str(2**70), "-1"])
def test_reproduce_refuses_a_seed_out_of_range_before_running(runner: CliRunner, name: str,
                                                               seed: str) -> None:
    """A seed the experiments cannot use (torch.manual_seed overflows past 2**64, and
    they seed with seed x 1000 + repetition) is a usage error naming --seed and its
    range, before anything runs; before, correlated-noise-adult-bert --seed 2**70 ran
    and ended in a traceback."""
    line = _error_line(runner, ["reproduce", name, "--quick", "--seed", seed])
    assert line.startswith("error: Invalid value for '--seed'") and "4294967295" in line


def test_bad_value_message_has_range_and_value(runner: CliRunner) -> None:
    r = runner.invoke(
        cli, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5", "--sampling-rate", "1.5"]
    )
    # (privlearn._validation appends what to try after the value)
    assert r.stderr.strip().startswith("error: --sampling-rate must be in (0, 1], got 1.5")


@pytest.mark.parametrize(("args", "command"), [
    (["nosuchcommand"], "privlearn"),
    (["epsilon", "--delta", "1e-5"], "privlearn epsilon"),
    (["epsilon", "--noise-multipler", "1", "--delta", "1e-5"], "privlearn epsilon"),
    (["budget", "show"], "privlearn budget show"),
    (["budget", "nosuchcommand"], "privlearn budget"),
])
def test_usage_error_says_where_the_usage_is(runner: CliRunner, args: list[str],
                                             command: str) -> None:
    """The one line replaces click's usage block, so it names the help to read."""
    line = _error_line(runner, args, prog_name="privlearn")
    assert line.endswith(f"`{command} --help`"), line
    # the help it names exists
    assert invoke(runner, [*command.split()[1:], "--help"]).exit_code == 0


@pytest.mark.parametrize("group", [[], ["budget"], ["audit"]])
def test_a_group_without_its_command_prints_its_help(runner: CliRunner,
                                                     group: list[str]) -> None:
    """``privlearn`` (or ``privlearn budget``) alone: the group's help as --help prints
    it (one command per line, not squeezed into one error line), status 2."""
    r = runner.invoke(cli, group)
    assert r.exit_code == 2 and r.stdout == ""
    assert not r.stderr.startswith("error: ")
    assert r.stderr.strip() == invoke(runner, [*group, "--help"]).stdout.strip()
    commands = r.stderr.split("Commands:\n")[1].rstrip().splitlines()
    assert commands and all(line.startswith("  ") for line in commands)


def test_unsupported_calibration_exits_2(runner: CliRunner) -> None:
    """An accountant that cannot evaluate the mechanism: one line, exit 2."""
    line = _error_line(runner, ["calibrate", "--target-epsilon", "1", "--delta", "1e-5",
                                "--sampling-rate", "0.1", "--accountant", "analytic"])
    assert "analytic" in line


def _helps(command, path):
    """``--help`` of ``command`` and of every subcommand, as (command path, text)."""
    import click

    yield path, command.get_help(click.Context(command, info_name=path))
    for name, sub in getattr(command, "commands", {}).items():
        yield from _helps(sub, f"{path} {name}")


def test_help_points_to_what_an_installed_package_has(runner, tmp_path, monkeypatch) -> None:
    """An installed package has no docs/ folder: no --help names a file there. The
    commands that ``budget --help`` shows run as printed."""
    import shlex

    helps = dict(_helps(cli, "privlearn"))
    assert len(helps) > 10
    for path, text in helps.items():
        assert "docs/" not in text and ".md" not in text, path
    shown = helps["privlearn budget"].replace("\\\n", " ")
    lines = [line.strip() for line in shown.splitlines()
             if line.strip().startswith("privlearn budget ")]
    assert [shlex.split(line)[2] for line in lines] == ["init", "spend", "show"]
    monkeypatch.chdir(tmp_path)
    for line in lines:
        r = invoke(runner, shlex.split(line)[1:])
        assert r.exit_code == 0, (line, r.output)
    assert "1 release(s)" in r.stdout
    import privlearn.ledger

    assert "privlearn.ledger.Ledger " in " ".join(shown.split())
    assert hasattr(privlearn.ledger, "Ledger")


# -- version, demo, reproduce ----------------------------------------------------------
def test_version(runner: CliRunner) -> None:
    r = invoke(runner, ["--version"])
    assert r.exit_code == 0
    assert __version__ in r.stdout


def test_demo_prints_table_fast(runner: CliRunner, stopwatch) -> None:
    # the stopwatch's measure (the smaller of wall and CPU time): a loaded machine inflates
    # the wall time, idle-spinning BLAS threads of a many-core machine the CPU time
    with stopwatch() as took:
        r = invoke(runner, ["demo", "--no-experiment"])
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
    assert took.seconds < 5.0


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
    assert "NAME" in _error_line(runner, ["reproduce", "no-such-experiment"])


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
    assert bad.stderr.strip().startswith(
        "error: --noise-multiplier must be in (0, inf) and finite, got -2.0")


def test_python_dash_m() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "privlearn", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0
    assert __version__ in p.stdout


@pytest.fixture()
def runs(monkeypatch, tmp_path) -> list[tuple[str, dict]]:
    """The (name, options) of each call of ``privlearn.experiments.run_experiment``,
    replaced by a recorder whose result lists the one file ``tmp_path / "x.csv"``."""
    experiments = pytest.importorskip("privlearn.experiments")
    calls: list[tuple[str, dict]] = []

    class Result:
        paths = [tmp_path / "x.csv"]

    monkeypatch.setattr(experiments, "run_experiment",
                        lambda name, **kw: calls.append((name, kw)) or Result())
    return calls


def test_reproduce_forwards_options(runner: CliRunner, runs, tmp_path) -> None:
    import privlearn.experiments as experiments

    name = sorted(experiments.EXPERIMENTS)[0]
    r = invoke(runner, ["reproduce", name, "--out", str(tmp_path), "--reps", "3", "--seed", "7"])
    assert r.exit_code == 0, r.output
    assert runs == [(name, {"out_dir": str(tmp_path), "reps": 3, "seed": 7})]
    assert f"wrote {tmp_path / 'x.csv'}" in r.stdout
    r = invoke(runner, ["reproduce", name])
    assert runs[-1] == (name, {})


# -- --batch-size / --dataset-size / --epochs ------------------------------------------
EPOCH_FORM = ["--batch-size", "512", "--dataset-size", "50000", "--epochs", "30"]


def test_epoch_form_equals_rate_and_steps(runner: CliRunner) -> None:
    """B=512, N=50000, 30 epochs is sampling rate 512/50000 and 30 x round(50000 / 512) =
    2940 steps -- the steps make_private's loader takes, not ceil(30 x 50000 / 512) =
    2930 -- and the same epsilon as the equivalent --sampling-rate/--steps call."""
    common = ["epsilon", "--noise-multiplier", "1.0", "--delta", "1e-5", "--json"]
    a = _json(runner, [*common, *EPOCH_FORM])
    b = _json(runner, [*common, "--sampling-rate", str(512 / 50000), "--steps", "2940"])
    assert a == b
    assert (a["sampling_rate"], a["steps"]) == (0.01024, 2940)
    assert a["epsilon"] == compose(subsample(Gaussian(1.0), 0.01024), steps=2940).epsilon(1e-5)


@pytest.mark.parametrize(("b", "n", "e"), [
    (512, 50000, 30), (256, 60000, 60), (1, 7, 3), (3, 4, 2), (100, 100, 5), (64, 96, 7),
    (7, 1000, 1), (999, 1000, 4), (300, 1000, 3),
])
def test_epoch_form_counts_the_planned_steps(runner: CliRunner, b: int, n: int, e: int) -> None:
    """The CLI counts steps with the one rule shared with make_private
    (privlearn.accounting.planned_steps), whose loader yields round(n / b) Poisson batches
    per epoch: E x max(1, round(n / b)) steps."""
    from privlearn.accounting import planned_steps

    steps = _json(runner, ["epsilon", "--noise-multiplier", "2", "--delta", "1e-9",
                           "--batch-size", str(b), "--dataset-size", str(n), "--epochs",
                           str(e), "--json"])["steps"]
    assert steps == planned_steps(b / n, e) == e * max(1, round(n / b))


def test_epoch_form_warns_when_delta_is_not_below_one_over_n(runner: CliRunner) -> None:
    """delta >= 1/N allows publishing a record in the clear: a warning on stderr, exit 0."""
    args = ["--batch-size", "10", "--dataset-size", "1000", "--epochs", "1"]
    for cmd in (["epsilon", "--noise-multiplier", "1"], ["calibrate", "--target-epsilon", "1"]):
        r = runner.invoke(cli, [*cmd, "--delta", "1e-3", *args, "--json"])
        assert r.exit_code == 0, r.output
        json.loads(r.stdout)  # stdout stays one JSON object
        assert r.stderr.startswith("warning: --delta=0.001 is at least 1/n = 1/1000")
        r = runner.invoke(cli, [*cmd, "--delta", "1e-5", *args])
        assert r.exit_code == 0 and r.stderr == ""


def test_calibrate_epoch_form(runner: CliRunner) -> None:
    out = _json(runner, ["calibrate", "--target-epsilon", "3", "--delta", "1e-5", *EPOCH_FORM,
                         "--json"])
    assert (out["sampling_rate"], out["steps"]) == (0.01024, 2940)
    m = compose(subsample(Gaussian(out["noise_multiplier"]), 0.01024), steps=2940)
    assert m.epsilon(1e-5) <= 3.0


@pytest.mark.parametrize("extra", [["--sampling-rate", "0.01"], ["--steps", "10"]])
def test_mixing_the_two_forms_is_refused(runner: CliRunner, extra: list[str]) -> None:
    line = _error_line(runner, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5",
                                *EPOCH_FORM, *extra])
    assert extra[0] in line and "either" in line


def test_epoch_form_incomplete_or_bad(runner: CliRunner) -> None:
    r = runner.invoke(cli, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5",
                            "--batch-size", "10", "--dataset-size", "100"])
    assert r.exit_code == 2 and "--epochs missing" in r.stderr
    r = runner.invoke(cli, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5",
                            "--batch-size", "200", "--dataset-size", "100", "--epochs", "1"])
    assert r.exit_code == 2
    assert "--batch-size must be <= --dataset-size" in r.stderr and "got" in r.stderr


def test_steps_is_an_integer_option(runner: CliRunner) -> None:
    r = invoke(runner, ["epsilon", "--help"])
    assert "--steps INTEGER" in r.stdout
    r = runner.invoke(cli, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5",
                            "--steps", "2929.69"])
    assert r.exit_code == 2 and "--steps" in r.stderr


# -- accounting failures end with what to try ------------------------------------------
@pytest.mark.parametrize("command", [
    ["epsilon", "--noise-multiplier", "1"],
    ["calibrate", "--target-epsilon", "1"],
])
def test_gaussian_delta_zero_suggests_laplace(runner: CliRunner, command: list[str]) -> None:
    """Was: `epsilon --delta 0` printed inf with status 0."""
    line = _error_line(runner, [*command, "--delta", "0", "--steps", "10"])
    assert line.endswith("try --mechanism laplace for pure DP, or a positive --delta "
                         "such as 1e-5")


def test_long_run_tiny_delta_certified_by_pld_below_rdp(runner: CliRunner) -> None:
    """10^6 steps at delta 1e-9: the plain PLD grid cannot certify delta; the tilted
    composition does, with a lower bound, below RDP's 8.79, and the output
    names the accountant that answered."""
    args = ["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.001", "--steps",
            "1000000", "--delta", "1e-9"]
    r = invoke(runner, args)
    assert r.exit_code == 0, r.output
    assert "pld accountant" in r.stdout and "lower bound" in r.stdout
    ours = _json(runner, [*args, "--json"])
    rdp = _json(runner, [*args, "--accountant", "rdp", "--json"])["epsilon"]
    assert rdp == pytest.approx(8.79, abs=0.01)
    assert ours["epsilon_lower"] <= ours["epsilon"] <= 1.01 * ours["epsilon_lower"]
    assert ours["epsilon"] < rdp


def test_uncertifiable_delta_message_suggests_rdp(runner: CliRunner, monkeypatch) -> None:
    """Where the PLD accountant still cannot certify (fallback off), the one-line error
    ends with what to try."""
    import privlearn.cli.accounting as cli_mod
    from privlearn.errors import CertificationError

    def failing(*args, **kwargs):
        raise CertificationError("pld: cannot certify delta=1e-09 on this grid")

    monkeypatch.setattr(cli_mod, "build_mechanism", lambda *a, **k: _Failing(failing))
    line = _error_line(runner, ["epsilon", "--noise-multiplier", "1", "--sampling-rate",
                                "0.001", "--steps", "1000000", "--delta", "1e-9"])
    assert "cannot certify" in line
    assert line.endswith("try --accountant rdp (Renyi DP needs no tail certification and "
                         "gives a valid, looser bound) or a larger --delta")


class _Failing:
    def __init__(self, fn):
        self.epsilon = self.epsilon_bounds = self.delta = fn


def test_privacy_loss_overflow_suggests_more_noise(runner: CliRunner, monkeypatch) -> None:
    """A privacy loss too large to represent (PrivacyLossOverflowError): the hint is
    chosen by the error's type."""
    import privlearn.cli.accounting as cli_mod
    from privlearn.errors import PrivacyLossOverflowError

    def failing(*args, **kwargs):
        raise PrivacyLossOverflowError("pld: the privacy loss tail does not vanish")

    monkeypatch.setattr(cli_mod, "build_mechanism", lambda *a, **k: _Failing(failing))
    line = _error_line(runner, ["epsilon", "--noise-multiplier", "0.001", "--sampling-rate",
                                "0.5", "--steps", "10", "--delta", "1e-5"])
    assert line == ("error: epsilon of gaussian, noise multiplier 0.001, poisson sampling at "
                    "rate 0.5, 10 steps at delta=1e-05 cannot be represented (pld accountant: "
                    "pld: the privacy loss tail does not vanish); try a larger "
                    "--noise-multiplier or fewer --steps (with this little noise the run is "
                    "essentially non-private)")


def test_an_overflow_names_the_run_as_given_not_the_accountants_reduced_form(
        runner: CliRunner) -> None:
    """10**20 steps of noise multiplier 1: the composition is the one Gaussian of noise
    multiplier 1 / sqrt(10**20) = 1e-10, whose epsilon overflows; the message names the
    noise multiplier and steps given (not 1e-10, which was never typed) and suggests
    fewer steps too."""
    line = _error_line(runner, ["epsilon", "--noise-multiplier", "1", "--steps",
                                str(10**20), "--delta", "1e-5"])
    assert line.startswith("error: epsilon of gaussian, noise multiplier 1, no subsampling, "
                           f"{10**20} steps at delta=1e-05 cannot be represented")
    assert line.endswith("try a larger --noise-multiplier or fewer --steps (with this "
                         "little noise the run is essentially non-private)")


def test_tiny_laplace_noise_gets_its_finite_pure_epsilon(runner: CliRunner) -> None:
    """Laplace noise 0.001 at rate 0.5: the pure epsilon log(1 + q (e^1000 - 1)) per step
    is finite (it used to overflow in math.expm1 and was reported as an error)."""
    import mpmath

    with mpmath.workdps(30):
        exact = 10 * mpmath.log1p(0.5 * mpmath.expm1(1000))  # pure epsilon of 10 steps
    args = ["epsilon", "--mechanism", "laplace", "--noise-multiplier", "0.001",
            "--sampling-rate", "0.5", "--steps", "10", "--json"]
    pure = _json(runner, [*args, "--delta", "0"])["epsilon"]
    assert exact <= pure <= float(exact) * (1 + 1e-12)
    eps = _json(runner, [*args, "--delta", "1e-5"])["epsilon"]
    assert eps <= pure
    assert eps == compose(subsample(Laplace(0.001), 0.5), steps=10).epsilon(1e-5)


def test_tiny_gaussian_noise_is_answered_by_a_certified_fallback(runner: CliRunner) -> None:
    # (below the noise multipliers the PLD grid reaches, ~7e-4)
    r = invoke(runner, ["epsilon", "--noise-multiplier", "0.0003", "--sampling-rate", "0.5",
                        "--steps", "10", "--delta", "1e-5"])
    assert r.exit_code == 0, r.output
    assert "rdp accountant" in r.stdout


def test_unreachable_calibration_suggests_what_to_change(runner: CliRunner) -> None:
    line = _error_line(runner, ["calibrate", "--mechanism", "laplace", "--target-epsilon",
                                "1e-13", "--delta", "0", "--steps", "10"])
    assert "unreachable" in line
    assert line.endswith("try a larger --target-epsilon or --delta, fewer --steps/--epochs, "
                         "or a smaller --sampling-rate/--batch-size")


def test_calibration_accounting_error_surfaces_as_calibration_error(runner: CliRunner,
                                                                    monkeypatch) -> None:
    """An AccountingError raised inside the calibration is reported as a failed
    calibration (CalibrationError) carrying the accountant's message; the hint follows
    the type of the accountant's error (its cause)."""
    import privlearn.cli._app as app_mod
    import privlearn.cli.accounting as cli_mod
    from privlearn.errors import CalibrationError, PrivacyLossOverflowError

    def failing_calibrate(*args, **kwargs):
        raise PrivacyLossOverflowError("pld: privacy loss tail does not vanish below loss 1e4")

    seen = []
    real_hint = app_mod._hint

    def spy(err, command):
        seen.append(err)
        return real_hint(err, command)

    monkeypatch.setattr(cli_mod, "calibrate", failing_calibrate)
    monkeypatch.setattr(app_mod, "_hint", spy)
    line = _error_line(runner, ["calibrate", "--target-epsilon", "50", "--delta", "1e-5",
                                "--sampling-rate", "0.5", "--steps", "10"])
    assert isinstance(seen[0], CalibrationError)
    assert isinstance(seen[0].__cause__, PrivacyLossOverflowError)
    assert line == ("error: calibration failed: pld: privacy loss tail does not vanish "
                    "below loss 1e4; try a smaller --target-epsilon or --accountant rdp (the "
                    "search reached noise so small that the privacy loss cannot be "
                    "represented)")


def test_unexpected_errors_are_not_turned_into_one_liners(runner: CliRunner,
                                                          monkeypatch) -> None:
    """A plain ValueError (or any type the CLI does not map) is a bug: it propagates with
    its traceback and status 1, it is never reported as a user error."""
    import privlearn.cli.accounting as cli_mod

    def broken(*args, **kwargs):
        raise ValueError("internal bug")

    monkeypatch.setattr(cli_mod, "build_mechanism", broken)
    r = runner.invoke(cli, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5"])
    assert r.exit_code == 1
    assert isinstance(r.exception, ValueError) and str(r.exception) == "internal bug"
    assert "error:" not in r.stderr
    proc = subprocess.run([sys.executable, "-c", (
        "import privlearn.cli.accounting as c\n"
        "def broken(*a, **k):\n    raise ValueError('internal bug')\n"
        "c.build_mechanism = broken\n"
        "import privlearn.cli\n"
        "privlearn.cli.main(['epsilon', '--noise-multiplier', '1', '--delta', '1e-5'])\n")],
        capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ValueError: internal bug" in proc.stderr


@pytest.mark.parametrize(("error", "status"), [
    ("ParameterValueError", 2), ("ParameterTypeError", 2), ("UnsupportedMechanismError", 2),
    ("AccountingError", 2), ("CertificationError", 2), ("PrivacyLossOverflowError", 2),
    ("CalibrationError", 2), ("LedgerNotFoundError", 2), ("UnknownBudgetError", 2),
    ("LedgerConflictError", 2), ("DataNotFoundError", 2), ("BudgetExceededError", 3),
    ("LedgerIntegrityError", 4),
])
def test_exit_status_follows_the_error_type(runner: CliRunner, monkeypatch, error: str,
                                            status: int) -> None:
    import privlearn.cli.accounting as cli_mod
    from privlearn import errors

    def failing(*args, **kwargs):
        raise getattr(errors, error)("the message")

    monkeypatch.setattr(cli_mod, "build_mechanism", failing)
    r = runner.invoke(cli, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5"])
    assert r.exit_code == status, r.output
    assert r.stderr.startswith("error: the message") and r.stderr.count("\n") == 1
    assert r.stdout == ""


def test_real_calibration_reaching_tiny_noise(runner: CliRunner) -> None:
    out = _json(runner, ["calibrate", "--target-epsilon", "2000", "--delta", "1e-5",
                         "--sampling-rate", "0.5", "--steps", "10", "--json"])
    m = compose(subsample(Gaussian(out["noise_multiplier"]), 0.5), steps=10)
    assert m.epsilon(1e-5) <= 2000


def test_unsupported_accountant_suggests_others(runner: CliRunner) -> None:
    line = _error_line(runner, ["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1",
                                "--delta", "1e-5", "--accountant", "analytic"])
    assert line.endswith("try --accountant pld or --accountant rdp")


@pytest.mark.parametrize(("args", "passed"), [
    (["epsilon", "--noise-multiplier", "1.1", "--sampling-rate", "0.01", "--steps", "100"],
     "gaussian, noise multiplier 1.1, poisson sampling at rate 0.01, 100 steps"),
    (["epsilon", "--noise-multiplier", "2", "--mechanism", "laplace", "--steps", "3"],
     "laplace, noise multiplier 2, no subsampling, 3 steps"),
    (["epsilon", "--noise-multiplier", "1", "--batch-size", "64", "--dataset-size", "6400",
      "--epochs", "2"], "gaussian, noise multiplier 1, poisson sampling at rate 0.01, 200 steps"),
    (["calibrate", "--target-epsilon", "1", "--sampling-rate", "0.01", "--steps", "100",
      "--sampling", "fixed"], "gaussian, fixed sampling at rate 0.01, 100 steps"),
])
def test_an_accountant_refusing_the_run_says_what_was_passed(runner, args, passed) -> None:
    """The refusal is in the options' words (what was passed, what the accountant covers,
    which accountant to use), not the names of the library's mechanism classes."""
    line = _error_line(runner, [*args, "--delta", "1e-5", "--accountant", "analytic"])
    assert line.startswith(f"error: --accountant analytic cannot account {passed} "
                           "(analytic: exact, Gaussian compositions without subsampling only)")
    assert line.endswith("try --accountant pld or --accountant rdp")
    assert not any(name in line for name in ("Composed", "Subsampled", "Laplace(", "Gaussian("))


def test_accountant_choices_come_from_the_registry(monkeypatch) -> None:
    """The choices are read from the registry when the command runs (an accountant
    registered after the CLI was imported is offered too)."""
    import privlearn.accounting as acc
    import privlearn.cli.accounting as cli_mod

    monkeypatch.setattr(acc, "available_accountants", lambda: ["pld", "rdp", "analytic", "x"])
    opt = next(p for p in cli_mod.epsilon.params if p.name == "accountant")
    assert list(opt.type.choices) == ["pld", "rdp", "analytic", "x"]


# -- reproduce: data location ----------------------------------------------------------
def test_reproduce_missing_data_is_one_line(runner: CliRunner, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PRIVLEARN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    empty = tmp_path / "empty"
    empty.mkdir()
    for extra in ([], ["--data-home", str(empty)]):
        r = runner.invoke(cli, ["reproduce", "label-release", "--out", str(tmp_path / "o"),
                                *extra])
        assert r.exit_code == 2  # bad input, as documented (1 is an unexpected error)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert lines[0].startswith("error: label-release: MNIST files not found in ")
        assert lines[0].endswith("run again with --data-home DIR (a directory holding the "
                                 "files) or --download")
        # in the shell's words: the places searched and the options, not Python's keywords
        assert "data_home=" not in lines[0] and "download=True" not in lines[0], lines[0]
        assert "$PRIVLEARN_DATA" in lines[0]
        assert (str(empty) in lines[0]) == bool(extra)
        assert "Traceback" not in r.output


def test_reproduce_data_options_forwarded(runner: CliRunner, runs, tmp_path) -> None:
    r = invoke(runner, ["reproduce", "label-release", "--data-home", str(tmp_path),
                        "--download"])
    assert r.exit_code == 0, r.output
    assert runs == [("label-release", {"data_home": str(tmp_path), "download": True})]
    r = runner.invoke(cli, ["reproduce", "adult", "--data-home", str(tmp_path)])
    assert r.exit_code == 2 and "apply only to " in r.stderr
    assert "label-release" in r.stderr and "correlated-noise" in r.stderr


def test_reproduce_quick_forwarded_where_the_experiment_has_one(runner: CliRunner, runs,
                                                                tmp_path) -> None:
    r = invoke(runner, ["reproduce", "correlated-noise", "--quick", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert runs == [("correlated-noise", {"out_dir": str(tmp_path), "quick": True})]
    r = runner.invoke(cli, ["reproduce", "adult", "--quick"])
    assert r.exit_code == 2 and "--quick applies only to correlated-noise" in r.stderr
    assert len(runs) == 1


def test_reproduce_missing_extra_is_one_line(runner: CliRunner, monkeypatch) -> None:
    experiments = pytest.importorskip("privlearn.experiments")

    def no_torch(name, **kw):
        raise ImportError("the correlated-noise study trains PyTorch models and needs the "
                          "torch extra (pip install 'privlearn[torch]'): No module named "
                          "'torch'")

    monkeypatch.setattr(experiments, "run_experiment", no_torch)
    assert "privlearn[torch]" in _error_line(runner, ["reproduce", "correlated-noise",
                                                      "--quick"])


def test_user_facing_text_has_no_seed_jargon(runner: CliRunner) -> None:
    import re

    texts = [invoke(runner, [*cmd, "--help"]).stdout
             for cmd in (["epsilon"], ["calibrate"], ["demo"], ["reproduce"], [])]
    texts.append(invoke(runner, ["demo", "--no-experiment"]).stdout)
    for text in texts:
        assert not re.search(r"seed \d{3}|seed's|seeds'", text, re.I), text


def test_a_subnormal_delta_gives_an_epsilon_not_a_traceback(runner: CliRunner) -> None:
    # 1e-6 * delta underflowed to 0 in the PLD's tilted-tail tolerance: math.log(0),
    # "ValueError: math domain error" and status 1
    args = ["epsilon", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--steps", "10",
            "--json", "--delta"]
    eps = {}
    for delta in ("1e-300", "1e-320"):
        eps[delta] = _json(runner, [*args, delta])["epsilon"]
    # a smaller delta needs a larger epsilon (the RDP conversion's log(1/delta) term)
    assert math.isfinite(eps["1e-320"]) and eps["1e-320"] >= eps["1e-300"]


def test_reproduce_refuses_an_out_directory_it_cannot_write_before_running(
        runner: CliRunner, tmp_path, monkeypatch) -> None:
    # a read-only file system: the experiment ran, then its mkdir was a traceback
    import errno
    import os

    import privlearn.experiments as experiments

    def not_run(*args, **kwargs):
        raise AssertionError("ran before --out was checked")

    real_open, real_mkdir = os.open, os.mkdir

    def read_only(real):
        def refuse(path, *args, **kwargs):
            if str(path).startswith(str(tmp_path / "ro")):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real(path, *args, **kwargs)
        return refuse

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(experiments, "run_experiment", not_run)
    monkeypatch.setattr(os, "open", read_only(real_open))
    monkeypatch.setattr(os, "mkdir", read_only(real_mkdir))
    for out in (tmp_path / "ro", tmp_path / "ro" / "new"):
        r = runner.invoke(cli, ["reproduce", "linear-regression", "--out", str(out)])
        assert r.exit_code == 2, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "--out" in lines[0] and "Read-only" in lines[0], r.stderr


@pytest.mark.parametrize("count", ["1", str(10**22)])
def test_audit_canaries_out_of_range_is_a_usage_error(runner: CliRunner, count) -> None:
    # a huge count was a numpy TypeError (traceback) after the calibration
    r = runner.invoke(cli, ["audit", "dpsgd", "--epsilon", "1", "--delta", "1e-5",
                            "--canaries", count])
    assert r.exit_code == 2, r.output
    assert "'--canaries'" in r.output and "2<=x<=1000000000" in r.output


def test_ctrl_c_exits_130_with_one_line(runner: CliRunner, monkeypatch) -> None:
    """Ctrl-C is an interruption, not a bug: status 130 (128 + SIGINT, what a shell reports
    for an interrupted command) and one line, no traceback; status 1 stays for bugs."""
    import privlearn.cli.accounting as cli_mod

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_mod, "build_mechanism", interrupted)
    r = runner.invoke(cli, ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5"])
    assert r.exit_code == 130, r.output
    assert r.stderr.strip() == "error: interrupted" and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_sigint_in_a_running_command_exits_130() -> None:
    """A real SIGINT delivered to ``python -m privlearn`` while a command runs. (The child
    restores Python's own SIGINT handler first: a process started by one that ignores
    SIGINT, as a test worker may, inherits the ignoring and would sleep through it.)"""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", (
        "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import time, privlearn.cli.accounting as c\n"
        "def slow(*a, **k):\n"
        "    print('ready', flush=True)\n    time.sleep(60)\n"
        "c.build_mechanism = slow\n"
        "import privlearn.cli\n"
        "privlearn.cli.main(['epsilon', '--noise-multiplier', '1', '--delta', '1e-5'])\n")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip() == "error: interrupted" and "Traceback" not in err
