"""The correlated-noise study: its small configuration end to end (files written, numbers
in range, the table re-derived from the runs file), its plans against closed forms and
dense matrices, and its settings refused at the boundary."""

import csv
import math

import numpy as np
import pytest

from privlearn.experiments import run_experiment

pytest.importorskip("torch")


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("correlated")
    try:
        return run_experiment("correlated-noise", out, quick=True, verbose=False)
    except FileNotFoundError:
        pytest.skip("MNIST not available")


def test_quick_study_writes_its_files(quick):
    from privlearn.experiments.correlated_noise import QUICK, STRATEGIES

    csv_path, png, runs_path, md_path = quick.paths
    assert csv_path.name == "correlated_noise.csv" and png.name == "correlated_noise.png"
    assert png.stat().st_size > 10_000
    rows = _rows(csv_path)
    assert [r["method"] for r in rows] == [s.name for s in STRATEGIES] * len(QUICK.epsilons)
    n_runs = len(STRATEGIES) * len(QUICK.epsilons) * (len(QUICK.learning_rates) + 1)
    assert len(_rows(runs_path)) == n_runs
    text = md_path.read_text()
    assert "| epsilon | DP-SGD | banded | BLT |" in text
    assert f"Tuning: {n_runs - len(rows)} training runs" in text and "not accounted" in text


def test_quick_study_numbers_in_range(quick):
    for r in quick.rows:
        eps = r["epsilon"]
        # far above chance (0.1) after 80 steps on 2,000 images at epsilon 8
        assert 0.4 < r["min_accuracy"] <= r["median_accuracy"] <= r["max_accuracy"] <= 1.0
        assert 0.4 < r["val_accuracy"] <= 1.0
        # the accountant's epsilon of the steps taken: the plan, never above the target
        assert 0.9 * eps < r["epsilon_spent"] <= eps
        assert r["steps"] == 2 * round(2000 / 50)
        assert r["tuning_seconds"] > 0 and r["final_seconds"] > 0
    assert quick.summary["tuning_runs"] == 6 and quick.summary["final_runs"] == 3


def test_quick_study_table_follows_from_its_runs(quick):
    """The tuned learning rate is the argmax of the validation accuracies in the runs
    file, and the reported accuracy the median of that learning rate's test runs."""
    runs = _rows(quick.paths[2])
    for r in quick.rows:
        mine = [x for x in runs if x["method"] == r["method"]
                and float(x["epsilon"]) == r["epsilon"]]
        tuning = {float(x["learning_rate"]): float(x["accuracy"]) for x in mine
                  if x["phase"] == "tuning"}
        assert all(x["evaluated_on"] == "validation" for x in mine if x["phase"] == "tuning")
        assert r["learning_rate"] == max(tuning, key=tuning.get)
        final = [float(x["accuracy"]) for x in mine if x["phase"] == "final"]
        assert all(float(x["learning_rate"]) == r["learning_rate"] for x in mine
                   if x["phase"] == "final")
        assert r["median_accuracy"] == pytest.approx(float(np.median(final)), abs=0)
        assert r["tuning_seconds"] == pytest.approx(
            sum(float(x["seconds"]) for x in mine if x["phase"] == "tuning"))


def test_quick_study_dpsgd_plan_against_closed_forms(quick):
    """DP-SGD's noise multiplier is the accounting layer's calibration of T
    Poisson-subsampled Gaussians (q = B / N), and its noise RMSE the random walk's
    sigma C / B sqrt((T + 1) / 2)."""
    from privlearn.accounting import Gaussian, calibrate, compose, subsample

    r = next(x for x in quick.rows if x["method"] == "DP-SGD")
    T, q = r["steps"], 50 / 2000
    sigma = calibrate(lambda s: compose(subsample(Gaussian(s), rate=q), steps=T),
                      epsilon=r["epsilon"], delta=r["delta"])
    assert r["noise_multiplier"] == pytest.approx(sigma, rel=1e-9)
    assert r["noise_rmse"] == pytest.approx(sigma / 50 * math.sqrt((T + 1) / 2), rel=1e-9)
    assert r["noise_rmse_vs_dpsgd"] == 1.0


@pytest.mark.parametrize("settings", [
    {"noise": "dpsgd", "sampling": "poisson"},
    {"noise": "banded", "bands": 4, "sampling": "cyclic_poisson", "cycle_length": 4},
    {"noise": "blt", "buffers": 3, "sampling": "balls_in_bins"},
])
def test_plan_noise_rmse_against_dense_matrices(settings):
    """The plan's noise RMSE equals sigma C / B times the root mean squared row norm of
    A C^-1, with A (prefix sums) and C as dense matrices."""
    import torch

    from privlearn.correlated import Identity
    from privlearn.experiments._correlated_torch import plan_strategy

    plan = plan_strategy(settings, torch.zeros(400, 784), epsilon=4.0, delta=1e-5, epochs=2,
                         batch_size=20, max_grad_norm=0.5)
    n = plan.steps
    assert n == 40
    strategy = plan.run_settings["noise"]
    C = (Identity() if strategy == "dpsgd" else strategy).materialize(n)
    B = np.tril(np.ones((n, n))) @ np.linalg.inv(C)
    expected = plan.noise_multiplier * 0.5 / 20 * math.sqrt(np.mean(np.sum(B * B, axis=1)))
    assert plan.noise_rmse == pytest.approx(expected, rel=1e-9)
    assert plan.expected_batch_size == pytest.approx(20.0)


def test_banded_plan_is_the_amplified_mechanism():
    """The banded plan (cycle length = bands) is calibrated on Choquette-Choo et al.'s
    amplified reduction: ceil(T / b) Poisson-subsampled Gaussians at rate b B / N with
    noise multiplier sigma / (largest column norm of C)."""
    import torch

    from privlearn.accounting import Gaussian, compose, subsample
    from privlearn.experiments._correlated_torch import plan_strategy

    plan = plan_strategy({"noise": "banded", "bands": 4, "sampling": "cyclic_poisson",
                          "cycle_length": 4}, torch.zeros(400, 784), epsilon=4.0,
                         delta=1e-5, epochs=2, batch_size=20, max_grad_norm=1.0)
    C = plan.run_settings["noise"].materialize(plan.steps)
    column = float(np.max(np.linalg.norm(C, axis=0)))
    m = compose(subsample(Gaussian(plan.noise_multiplier / column), rate=4 * 20 / 400),
                steps=math.ceil(plan.steps / 4))
    assert m.epsilon(1e-5) == pytest.approx(4.0, rel=2e-3)
    assert m.epsilon(1e-5) <= 4.0 * (1 + 1e-9)


def test_bad_settings_are_refused_before_anything_is_read(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="epochs"):
        run_experiment("correlated-noise", out, epochs=0)
    with pytest.raises(TypeError, match="learning_rate.*settings are"):
        run_experiment("correlated-noise", out, learning_rate=0.1)
    with pytest.raises(ValueError, match="learning_rates"):
        run_experiment("correlated-noise", out, learning_rates=(1.0, -2.0))
    assert not out.exists()
