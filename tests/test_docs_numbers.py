"""The numbers the documentation quotes in its prose and in its transcripts are the ones
the code produces.

tests/test_docs.py runs every code block of the pages, but it does not compare what a
block prints with what the page says it prints, and it does not run the ``console``
transcripts at all. Each test here recomputes one quoted figure through the public API
(or runs the transcript's commands) and checks the page's text against it, so that a
change of the accounting, the calibration or a message shows up here instead of leaving
a page that tells a newcomer something the library no longer does.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from privlearn.accounting import Gaussian, calibrate, compose, planned_steps, subsample
from privlearn.cli import cli
from privlearn.datasets import load_california_housing, make_logistic_data
from privlearn.errors import BudgetExceededError
from privlearn.ledger import Ledger
from privlearn.models import AdaSSPRegressor, DPSGDClassifier

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _page(rel: str) -> str:
    """The page's text with its line breaks folded into spaces (prose wraps anywhere)."""
    return " ".join((DOCS / rel).read_text().split())


def _quoted(rel: str, pattern: str) -> tuple[str, ...]:
    m = re.search(pattern, _page(rel))
    assert m, f"{rel}: the sentence quoting the figures changed; update this test with it"
    return m.groups()


def _console_blocks(rel: str) -> list[list[str]]:
    """The ``console`` blocks of a page, each as its list of lines."""
    text = (DOCS / rel).read_text()
    return [b.splitlines() for b in re.findall(r"^```console\n(.*?)^```", text, re.S | re.M)]


def _sgd_run(noise_multiplier: float, rate: float, steps: int):
    return compose(subsample(Gaussian(noise_multiplier), rate=rate), steps=steps)


# -- tutorials/your-project: the totals after one, two and three runs of the script ------
def test_your_project_totals_after_each_run(tmp_path: Path) -> None:
    quoted = [
        float(x)
        for x in _quoted(
            "tutorials/your-project.md",
            r"about ([\d.]+) after one run, ([\d.]+) after two, ([\d.]+) after three",
        )
    ]
    text = _page("tutorials/your-project.md")
    # the page's own split: a fifth of its 4,000 rows held out by default_rng(1)
    n_train = int((np.random.default_rng(1).random(4000) >= 0.2).sum())
    assert f"64 / {n_train:,}" in text
    classifier = DPSGDClassifier(
        epsilon=1.0, delta=1e-7, sampling_rate=0.05, n_iter=500, classes=[0, 1]
    ).planned_mechanism(np.zeros((n_train, 6)))
    rate = 64 / n_train  # make_private: target (1.5, 1e-7), 4 epochs
    steps = planned_steps(rate, epochs=4)
    sigma = calibrate(lambda s: _sgd_run(s, rate, steps), epsilon=1.5, delta=1e-7)
    network = _sgd_run(sigma, rate, steps)

    ledger = Ledger(tmp_path / "privacy.db", create=True)
    ledger.create_budget("records", epsilon=3.0, delta=1e-6)
    totals = []
    for _ in range(3):
        ledger.spend("records", classifier)
        ledger.spend("records", network)
        totals.append(round(ledger.spent("records").epsilon_spent, 2))
    assert totals == quoted
    # the fourth run: the classifier still fits, the PyTorch run is refused
    assert "On the fourth, the classifier still fits, but the PyTorch run" in text
    ledger.spend("records", classifier)
    with pytest.raises(BudgetExceededError):
        ledger.spend("records", network)


# -- tutorials/pytorch: the noise multiplier the shell command is given ------------------
def test_pytorch_tutorial_shell_command_uses_the_calibrated_noise() -> None:
    (quoted,) = _quoted(
        "tutorials/pytorch.md",
        r"--noise-multiplier ([\d.]+) --batch-size 100 --dataset-size 1500 --epochs 15",
    )
    rate = 100 / 1500
    steps = planned_steps(rate, epochs=15)
    assert f"= {steps} steps" in _page("tutorials/pytorch.md")
    sigma = calibrate(lambda s: _sgd_run(s, rate, steps), epsilon=3.0, delta=1e-5)
    assert abs(sigma - float(quoted)) <= 5e-5  # the value the page prints, to 4 places
    # "prints an epsilon just under 3"
    assert 2.99 < _sgd_run(float(quoted), rate, steps).epsilon(1e-5) <= 3.0


# -- tutorials/ledger: four AdaSSP fits of epsilon 0.5 on one budget ---------------------
def test_ledger_tutorial_totals() -> None:
    (four,) = _quoted("tutorials/ledger.md", r"four of them cost ([\d.]+), not 2")
    (first,) = _quoted("tutorials/ledger.md", r"The first total, ([\d.]+), is below")
    d = load_california_housing(preprocessing="bounded")
    fit = AdaSSPRegressor(
        epsilon=0.5, delta=1e-7, x_bound=1.0, y_bound=5.0, fit_intercept=False
    ).planned_mechanism(d.data)
    totals = [compose([fit] * k).epsilon(1e-6) for k in range(1, 6)]
    assert f"{totals[0]:.2f}" == first and totals[0] < 0.5
    assert f"{totals[3]:.2f}" == four
    assert totals[3] <= 1.0 < totals[4]  # the fifth fit is refused


# -- guides/estimators: a given noise multiplier and the epsilon cap ---------------------
def test_estimators_guide_given_noise_spend() -> None:
    (quoted,) = _quoted(
        "guides/estimators.md",
        r"100 steps at noise multiplier 2 spend about ([\d.]+), within the cap",
    )
    data = make_logistic_data(2000, 1000, 5, random_state=1)
    clf = DPSGDClassifier(
        noise_multiplier=2.0,
        sampling_rate=0.1,
        n_iter=100,
        delta=1e-5,
        epsilon=10.0,
        classes=[0, 1],
    )
    spent = clf.planned_mechanism(data.X_train).epsilon(1e-5)
    assert f"{spent:.1f}" == quoted
    with pytest.raises(ValueError, match=f"spends epsilon={spent:.4f} > epsilon=1.0"):
        clf.set_params(epsilon=1.0).fit(data.X_train, data.y_train)


# -- guides/cli and guides/ledger: two DP-SGD runs on one budget, from the shell ---------
SPEND = [
    "budget",
    "spend",
    "privacy.db",
    "--dataset",
    "adult",
    "--mechanism",
    "gaussian",
    "--noise-multiplier",
    "1.1",
    "--sampling-rate",
    "0.01",
    "--steps",
    "1000",
]


def test_cli_guide_two_spends() -> None:
    two_quoted, one_quoted = _quoted(
        "guides/cli.md", r"The two spends above cost ([\d.]+), not twice ([\d.]+)"
    )
    one = _sgd_run(1.1, 0.01, 1000)
    assert f"{one.epsilon(1e-6):.2f}" == one_quoted
    assert f"{compose([one, one]).epsilon(1e-6):.2f}" == two_quoted
    assert compose([one] * 3).epsilon(1e-6) > 3.0  # "a third would exceed"


def test_ledger_guide_transcripts_are_what_the_commands_print(tmp_path, monkeypatch) -> None:
    """The ``privlearn budget`` transcripts of the ledger guide: ``init``, three spends
    (the third refused, status 3) and ``show --json``, each output line as printed."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    blocks = _console_blocks("guides/ledger.md")

    def run(args: list[str], status: int = 0) -> list[str]:
        r = runner.invoke(cli, args)
        assert r.exit_code == status, r.output
        return r.output.splitlines()

    def transcript(first_command: str) -> list[str]:
        return next(b for b in blocks if b and b[0].startswith(first_command))

    init = transcript("$ privlearn budget init privacy.db --dataset adult")
    assert (
        run(
            [
                "budget",
                "init",
                "privacy.db",
                "--dataset",
                "adult",
                "--epsilon",
                "3",
                "--delta",
                "1e-6",
            ]
        )
        == init[1:]
    )

    spends = transcript("$ privlearn budget spend privacy.db --dataset adult")
    out = (
        run(SPEND + ["--label", "dp-sgd run 1"])
        + run(SPEND + ["--label", "dp-sgd run 2"])
        + run(SPEND + ["--label", "dp-sgd run 3"], status=3)
    )
    printed = [line for line in spends if not line.startswith(("$", " "))]
    assert printed[-1] == "3"  # the `echo $?` of the refusal
    assert out == printed[:-1]

    show = transcript("$ privlearn budget show privacy.db --dataset adult --json")
    assert run(["budget", "show", "privacy.db", "--dataset", "adult", "--json"]) == [show[1]]


# -- guides/auditing: the self-test table and the three seeds of the correct engine ------
@pytest.mark.slow
def test_auditing_guide_table_is_what_the_audits_give() -> None:
    pytest.importorskip("torch")
    from privlearn.auditing.torch import audit_dpsgd

    text = _page("guides/auditing.md")
    rows = re.findall(
        r"\| `([\w.-]+)` \| [^|]+ \| ([\d.]+) \| ([\d.]+) \| (VIOLATION|no violation) \|", text
    )
    assert {bug for bug, *_ in rows} == {
        "none",
        "no-noise",
        "noise-x0.1",
        "no-clipping",
        "rate-x10",
    }
    for bug, claimed, bound, verdict in rows:
        r = audit_dpsgd(epsilon=2.0, delta=1e-5, bug=bug, seed=0).result
        assert (f"{r.claimed_epsilon:.2f}", f"{r.epsilon_lower_bound:.2f}") == (claimed, bound)
        assert r.violation == (verdict == "VIOLATION"), bug
    seeds = _quoted(
        "guides/auditing.md",
        r"at a claimed 2.0 gives ([\d.]+), ([\d.]+) and ([\d.]+) \(seeds 0, 1, 2\)",
    )
    got = [
        audit_dpsgd(epsilon=2.0, delta=1e-5, seed=s).result.epsilon_lower_bound for s in (0, 1, 2)
    ]
    assert [f"{g:.2f}" for g in got] == list(seeds)
    # the transcript at the top of the page: the same run, seed 0, to four places
    assert f"epsilon lower bound:    {got[0]:.4f}" in (DOCS / "guides/auditing.md").read_text()


@pytest.mark.slow
def test_auditing_guide_transcript_is_what_the_command_prints(tmp_path, monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    block = next(
        b
        for b in _console_blocks("guides/auditing.md")
        if b[0].startswith("$ privlearn audit dpsgd")
    )
    args = block[0].removeprefix("$ privlearn ").split()
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == block[1:]


# -- figures of the guides computed by the accountants alone -------------------------------
def test_guides_accounting_figures() -> None:
    from privlearn.accounting import ApproxDP

    # cli: counting ceil(E N / B) = 2930 steps instead of 2940
    (ceil_steps, eps) = _quoted(
        "guides/cli.md", r"= (\d+)\$ steps instead would .*? give ([\d.]+)\)"
    )
    got = _sgd_run(1.0, 512 / 50000, int(ceil_steps)).epsilon(1e-5)
    assert f"{got:.4f}" == eps
    # pytorch: fixed-size against Poisson batches at q = 0.01, sigma = 1, 1,000 steps
    fixed, poisson = _quoted("guides/pytorch.md", r"e\.g\. ([\d.]+) against Poisson's ([\d.]+)")
    run_fixed = compose(subsample(Gaussian(1.0), rate=0.01, scheme="fixed"), steps=1000)
    assert f"{run_fixed.epsilon(1e-5):.1f}" == fixed
    assert f"{_sgd_run(1.0, 0.01, 1000).epsilon(1e-5):.2f}" == poisson
    # ledger: ApproxDP releases composed by the optimal composition theorem
    two, ten = _quoted(
        "guides/ledger.md",
        r"`ApproxDP\(0\.5, 4e-6\)` twice costs ([\d.]+) of a `\(1, 1e-5\)` budget, and ten "
        r"`ApproxDP\(0\.1, 1e-6\)` cost ([\d.]+) of it",
    )
    assert compose([ApproxDP(0.5, 4e-6)] * 2).epsilon(1e-5) == pytest.approx(float(two), abs=5e-7)
    assert compose([ApproxDP(0.1, 1e-6)] * 10).epsilon(1e-5) == pytest.approx(float(ten), abs=5e-9)


@pytest.mark.slow
def test_correlated_noise_default_cycle_figures():
    """The small run the correlated-noise guide quotes (N = 1000, B = 64, one epoch,
    sigma = 1): DP-SGD's epsilon from the subsampled Gaussian, and the BLT's with one group
    and with an epoch's groups from the engine's plan (each optimises a BLT: seconds)."""
    torch = pytest.importorskip("torch")
    import warnings

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch.config import DPConfig
    from privlearn.torch.privacy_engine import plan_run

    one, dpsgd, epoch = _quoted(
        "guides/correlated-noise.md",
        r"accounted at epsilon ([\d.]+) where DP-SGD's is ([\d.]+); with the epoch cycle "
        r"it is ([\d.]+)",
    )
    assert f"{_sgd_run(1.0, 64 / 1000, 16).epsilon(1e-5):.2f}" == dpsgd

    def planned(**kw):
        cfg = DPConfig(noise_multiplier=1.0, epochs=1, sampling="cyclic_poisson", noise="blt", **kw)
        loader = DataLoader(TensorDataset(torch.zeros(1000, 1)), batch_size=64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return plan_run(cfg, nn.Linear(1, 1), loader).planned_epsilon

    assert f"{planned(cycle_length=1):.1f}" == one
    assert f"{planned():.2f}" == epoch
