"""Privacy regression tests: the real DP-SGD engine passes its audit and every planted
bug is caught (computed on every run; seeds fixed so the outcome is deterministic)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from privlearn.auditing._planted import BUGS, planted_bug  # noqa: E402
from privlearn.auditing.torch import (  # noqa: E402
    DiracCanaries,
    audit_dpsgd,
    loss_scores,
    trajectory_scores,
)
from privlearn.cli import cli  # noqa: E402

CLAIM = 2.0
DELTA = 1e-5


@pytest.fixture(scope="module")
def audits():
    # noise reused at every step keeps each step's law: the likelihood-ratio score misses
    # it, the squared changes of the movements catch it
    return {bug: audit_dpsgd(epsilon=CLAIM, delta=DELTA, n_canaries=1000, bug=bug, seed=0,
                             score="increments" if bug == "noise-reused" else "trajectory")
            for bug in BUGS}


def test_correct_engine_passes(audits):
    res = audits["none"].result
    assert res.claimed_epsilon == pytest.approx(CLAIM, rel=1e-3)
    assert not res.violation
    assert 0 <= res.epsilon_lower_bound < 0.5 * CLAIM
    # the canaries are seen (the attack is informative), just not beyond the claim
    assert res.auc > 0.55


@pytest.mark.parametrize("bug", [b for b in BUGS if b != "none"])
def test_planted_bug_is_caught(audits, bug):
    res = audits[bug].result
    assert res.claimed_epsilon == pytest.approx(CLAIM, rel=1e-3)  # the accountant is fooled
    assert res.violation, (bug, res)
    assert res.epsilon_lower_bound > 1.5 * CLAIM


def test_other_methods_agree_on_a_planted_bug():
    run = audit_dpsgd(epsilon=CLAIM, delta=DELTA, n_canaries=500, bug="no-clipping", seed=1,
                      method="one_run_fdp", score="final")
    assert run.result.violation and run.result.method == "one_run_fdp"


def _tiny_private(sampling_rate=0.1):
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    model = torch.nn.Linear(3, 1)
    ds = TensorDataset(torch.randn(100, 3), torch.randn(100, 1))
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(ds, batch_size=int(100 * sampling_rate)),
                        noise_multiplier=1.0, max_grad_norm=1.0, seed=0)


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bugs_are_undone_on_exit(bug):
    p = _tiny_private()
    sampler = p.data_loader.batch_sampler
    before = (dict(vars(p.optimizer)).keys(), dict(vars(p.optimizer.tracker)).keys(),
              type(sampler))
    std = p.optimizer._noise_std()
    with planted_bug(bug, p):
        if bug == "no-noise":
            assert p.optimizer._noise_std() == 0
        if bug == "noise-x0.1":
            assert p.optimizer._noise_std() == pytest.approx(0.1 * std)
        if bug == "rate-x10":
            sizes = [len(b) for b in sampler]
            assert np.mean(sizes) > 50  # 10 q N = 100 in expectation
    after = (dict(vars(p.optimizer)).keys(), dict(vars(p.optimizer.tracker)).keys(),
             type(sampler))
    assert before == after and p.optimizer._noise_std() == std
    with pytest.raises(ValueError, match="bug must be one of"):
        with planted_bug("bogus", p):
            pass


def test_trajectory_score_is_the_likelihood_ratio():
    # one step, q = 0.5, sigma = 1: log(1/2 + 1/2 exp(x - 1/2)) for the normalised move x
    snaps = np.array([[0.0, 0.0], [-1.0, 0.0]])  # canary 0 moved by one clipped gradient
    s = trajectory_scores(snaps, learning_rate=1.0, max_grad_norm=1.0, expected_batch_size=1.0,
                          noise_multiplier=1.0, sampling_rate=0.5)
    np.testing.assert_allclose(s, np.log(0.5 + 0.5 * np.exp([0.5, -0.5])))


def test_dirac_canary_gradient_is_a_dirac():
    c = DiracCanaries(5, gradient_norm=7.0)
    loss = c(torch.tensor([2, 5]), torch.tensor([1.0, 0.0])).sum()
    loss.backward()
    g = c.weight.weight.grad[:, 0]
    expect = torch.zeros(6)
    expect[2] = 7.0
    torch.testing.assert_close(g, expect)


def test_loss_scores():
    model = torch.nn.Linear(2, 2)
    x = torch.randn(4, 2)
    y = torch.tensor([0, 1, 0, 1])
    s = loss_scores(model, x, y)
    expect = -torch.nn.functional.cross_entropy(model(x), y, reduction="none").detach()
    np.testing.assert_allclose(s, expect.double().numpy(), rtol=1e-6)


def test_cli_json_is_one_object_and_catches_a_bug(tmp_path):
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "2", "--delta", "1e-5",
                                 "--canaries", "500", "--inject-bug", "no-noise", "--seed",
                                 "0", "--json", "--out", str(tmp_path)],
                           catch_exceptions=False)
    assert r.exit_code == 5, r.output  # a VIOLATION fails the command (a CI gate)
    out = json.loads(r.stdout)
    assert {"claimed_epsilon", "epsilon_lower_bound", "method", "canaries",
            "violation"} <= set(out)
    assert out["violation"] is True and out["canaries"] == 500
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["audit_dpsgd_no-noise_roc.csv", "audit_dpsgd_no-noise_roc.png",
                     "audit_dpsgd_no-noise_scores.csv"]


@pytest.mark.parametrize("args,match", [
    (["--delta", "0"], "--delta"), (["--delta", "1.5"], "delta"),
    (["--sampling-rate", "0.5"], "--sampling-rate"), (["--canaries", "1"], "--canaries"),
    (["--inject-bug", "bogus"], "inject-bug")])
def test_cli_bad_input_is_one_line(args, match):
    base = ["audit", "dpsgd", "--epsilon", "2", "--delta", "1e-5"]
    # later options override earlier ones
    r = CliRunner().invoke(cli, base + args)
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and match in r.stderr


def test_cli_out_directory_that_cannot_be_made_is_refused_before_training(
        monkeypatch, tmp_path):
    # it was created after the training, where the failure was a traceback (status 1)
    import privlearn.auditing.torch as audit_torch

    def no_training(**kw):
        raise AssertionError("trained before --out was checked")

    monkeypatch.setattr(audit_torch, "audit_dpsgd", no_training)
    (tmp_path / "a-file").write_text("")
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "2", "--delta", "1e-5",
                                 "--out", str(tmp_path / "a-file" / "report")])
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and "--out" in r.stderr


def test_cli_seed_beyond_64_bits_is_a_usage_error_naming_the_option(monkeypatch):
    # torch's generators take 64-bit seeds; the refusal named the Python parameter
    # ("seed must be None or ...; pass e.g. seed=0")
    import privlearn.auditing.torch as audit_torch

    def no_training(**kw):
        raise AssertionError("trained with a seed torch cannot take")

    monkeypatch.setattr(audit_torch, "audit_dpsgd", no_training)
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "2", "--delta", "1e-5",
                                 "--seed", str(2**64)])
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and "'--seed'" in r.stderr
    assert "18446744073709551615" in r.stderr and "seed=0" not in r.stderr


def test_cli_out_directory_that_cannot_be_written_is_refused_before_training(
        monkeypatch, tmp_path):
    # an existing directory on a read-only file system: the report's files failed to open
    # after the training, with a traceback (status 1)
    import errno
    import os

    import privlearn.auditing.torch as audit_torch

    def no_training(**kw):
        raise AssertionError("trained before --out was checked")

    out = tmp_path / "report"
    out.mkdir()
    real_open = os.open

    def read_only(path, *args, **kwargs):  # what EROFS on a file in the directory is
        if str(path).startswith(str(out)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(audit_torch, "audit_dpsgd", no_training)
    monkeypatch.setattr(os, "open", read_only)
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "2", "--delta", "1e-5",
                                 "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and "--out" in r.stderr and "Read-only" in r.stderr


@pytest.mark.parametrize(("violation", "status"), [(False, 0), (True, 5)])
@pytest.mark.parametrize("as_json", [False, True])
def test_cli_exit_status_is_the_verdict(monkeypatch, violation, status, as_json):
    """Status 5 exactly when the audit finds a VIOLATION, after the full report."""
    from types import SimpleNamespace

    import privlearn.auditing.torch as audit_torch

    result = SimpleNamespace(violation=violation, claimed_epsilon=2.0, epsilon_lower_bound=(
        3.0 if violation else 0.5), confidence=0.95, auc=0.6, seed=7)
    run = SimpleNamespace(result=result, noise_multiplier=1.5, sampling_rate=0.1, steps=50,
                          to_dict=lambda: {"violation": violation})
    monkeypatch.setattr(audit_torch, "audit_dpsgd", lambda **kw: run)
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "2", "--delta", "1e-5",
                                 *(["--json"] if as_json else [])])
    assert r.exit_code == status, r.output
    if as_json:
        assert json.loads(r.stdout) == {"violation": violation, "files": []}
    else:
        assert ("verdict:                VIOLATION" in r.stdout) == violation
        assert "seed:                   7" in r.stdout
    assert r.stderr == ""



def test_cli_prints_the_audit_warnings_as_one_line_each(monkeypatch):
    # e.g. a claim no outcome of the audit can refute: "warning: ..." on stderr, as the
    # other commands print theirs, and the report still on stdout
    import warnings
    from types import SimpleNamespace

    import privlearn.auditing.torch as audit_torch

    result = SimpleNamespace(violation=False, claimed_epsilon=9.0, epsilon_lower_bound=4.5,
                             confidence=0.95, auc=1.0, seed=0)

    def fake(**kw):
        warnings.warn("no outcome of this audit can refute the claim epsilon=9:\n even a "
                      "perfect attack ...", UserWarning, stacklevel=2)
        return SimpleNamespace(result=result, noise_multiplier=0.5, sampling_rate=0.1,
                               steps=50, to_dict=lambda: {})

    monkeypatch.setattr(audit_torch, "audit_dpsgd", fake)
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "9", "--delta", "1e-5"])
    assert r.exit_code == 0, r.output
    assert r.stderr == ("warning: no outcome of this audit can refute the claim epsilon=9: "
                        "even a perfect attack ...\n")
    assert "verdict:                no violation" in r.stdout


def test_cli_bug_is_an_alias_of_inject_bug(monkeypatch):
    from types import SimpleNamespace

    import privlearn.auditing.torch as audit_torch

    seen = {}
    result = SimpleNamespace(violation=True, claimed_epsilon=2.0, epsilon_lower_bound=3.0,
                             confidence=0.95, auc=0.9, seed=0)

    def fake(**kw):
        seen.update(kw)
        return SimpleNamespace(result=result, noise_multiplier=1.5, sampling_rate=0.1,
                               steps=50, to_dict=lambda: {})

    monkeypatch.setattr(audit_torch, "audit_dpsgd", fake)
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "2", "--delta", "1e-5",
                                 "--bug", "no-noise"])
    assert r.exit_code == 5, r.output
    assert seen["bug"] == "no-noise" and "planted bug:            no-noise" in r.output


def test_one_run_audit_takes_scores_as_a_tensor_that_requires_grad():
    # a scorer that returns a model output (requires grad) is scored like its values
    from privlearn.auditing import one_run_audit

    w = torch.ones(1, requires_grad=True)
    res = one_run_audit(lambda inc: torch.tensor(inc, dtype=torch.float32) * w, 200,
                        claimed_epsilon=1.0, delta=1e-5, seed=0)
    ref = one_run_audit(lambda inc: inc.astype(float), 200, claimed_epsilon=1.0,
                        delta=1e-5, seed=0)
    assert res.epsilon_lower_bound == ref.epsilon_lower_bound > 0


@pytest.mark.parametrize("steps", [10**14, 10_001])
def test_a_step_count_above_the_maximum_is_refused_before_any_work(steps, monkeypatch):
    """The audit's work is proportional to its steps (the calibration for that many, then
    every step trained): a count above MAX_AUDIT_STEPS is refused at once, from the API
    and from the shell (status 2 naming the option, the range and the value), not
    calibrated and trained for hours."""
    import privlearn.auditing.torch as audit_torch
    from privlearn.errors import ParameterValueError

    def no_work(*args, **kwargs):
        raise AssertionError("calibrated or trained before the steps were checked")

    monkeypatch.setattr(audit_torch, "_calibrated_sigma", no_work)
    monkeypatch.setattr(audit_torch, "one_run_audit", no_work)
    with pytest.raises(ParameterValueError,
                       match=rf"steps must be an integer in \[1, 10_000\], got {steps}"):
        audit_dpsgd(epsilon=1.0, delta=1e-5, steps=steps)
    r = CliRunner().invoke(cli, ["audit", "dpsgd", "--epsilon", "1", "--delta", "1e-5",
                                 "--steps", str(steps)])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: --steps must be an integer in [1, 10_000], got "
                               f"{steps} ") and "privlearn epsilon" in r.stderr
    assert r.stderr.count("\n") == 1
