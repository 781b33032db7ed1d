"""DPTrainer's releases and refusals around them: the privacy report saved next to the
weights, a spent budget refused before any batch is drawn (encoder-decoder models:
test_hf_seq2seq.py)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_trainer import B, N, _args, _eps, _TextSet  # noqa: E402

import privlearn  # noqa: E402
from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.errors import PrivacyBudgetExceededError  # noqa: E402
from privlearn.torch.accountant import PrivacyBudgetWarning  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402


def _gpt2(seed=0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _count_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def test_train_after_the_budget_is_spent_is_refused_before_any_batch(tmp_path):
    """A second train() of a trainer whose max_epsilon is spent: refused at its start,
    with no batch drawn and no forward pass (it drew and ran one before)."""
    cap = (_eps(1.0, 2) + _eps(1.0, 3)) / 2  # room for exactly 2 steps
    drawn = []

    def collate(features):
        drawn.append(len(features))
        return transformers.default_data_collator(features)

    model = _gpt2()
    tr = DPTrainer(model=model, args=_args(tmp_path, max_steps=5, logging_steps=50),
                   train_dataset=_TextSet(), data_collator=collate,
                   privacy=PrivacyArguments(noise_multiplier=1.0, max_epsilon=cap, seed=0))
    with pytest.warns(PrivacyBudgetWarning, match="stopped after step 2 of 5"):
        tr.train()
    assert tr.privacy_engine.accountant.steps == 2
    eps = tr.epsilon()
    forwards = _count_forwards(model)
    n_drawn = len(drawn)
    with pytest.raises(PrivacyBudgetExceededError, match="max_epsilon"):
        tr.train()
    assert len(drawn) == n_drawn and not forwards  # no batch drawn, no forward
    assert tr.privacy_engine.accountant.steps == 2 and tr.epsilon() == eps


def _strict_json(path):
    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c}")

    with open(path, encoding="utf-8") as f:
        return json.load(f, parse_constant=refuse)


def _keys(x):
    if isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from _keys(v)
    elif isinstance(x, list):
        for v in x:
            yield from _keys(v)


def test_saved_model_comes_with_its_privacy_report(tmp_path):
    """save_model writes privacy_report.json next to the weights: epsilon at target_delta
    equal to the closed-form composition of the steps taken, and the mechanism that ran;
    no seed, no training set size."""
    tr = DPTrainer(model=_gpt2(), args=_args(tmp_path / "out", max_steps=3),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.3, max_grad_norm=0.7,
                                            target_delta=1e-6, seed=987654321))
    tr.train()
    tr.save_model(str(tmp_path / "release"))
    assert (tmp_path / "release" / "model.safetensors").is_file()
    r = _strict_json(tmp_path / "release" / "privacy_report.json")
    assert r["delta"] == 1e-6 and r["accountant"] == "pld"
    assert r["epsilon"] == pytest.approx(_eps(1.3, 3, delta=1e-6), rel=1e-9)
    assert r["privlearn_version"] == privlearn.__version__
    m = r["mechanism"]
    assert (m["noise_multiplier"], m["max_grad_norm"], m["steps"]) == (1.3, 0.7, 3)
    assert m["sampling_rate"] == B / N and m["sampling"] == "poisson"
    assert m["scheme"] == "poisson" and m["neighbouring"] == "add_remove"
    assert m["segments"] == [{"noise_multiplier": 1.3, "sampling_rate": B / N,
                              "max_grad_norm": 0.7, "steps": 3}]
    assert r["earlier_runs"] == []
    keys = set(_keys(r))
    assert not keys & {"seed", "dataset_size", "sampler", "noise_state", "loss", "rank"}
    assert "987654321" not in json.dumps(r)  # not the seed in any form


def test_checkpoints_and_later_runs_report_what_they_cost(tmp_path):
    """Each checkpoint folder (what push_to_hub uploads) has the report of its step; a
    second run (model_init) reports the composition of both runs."""
    args = _args(tmp_path / "out", max_steps=2, save_strategy="steps", save_steps=1)
    tr = DPTrainer(model_init=lambda: _gpt2(), args=args, train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0),
                   private_state_dir=str(tmp_path / "private"))
    tr.train()
    for step in (1, 2):
        r = _strict_json(tmp_path / "out" / f"checkpoint-{step}" / "privacy_report.json")
        assert r["mechanism"]["steps"] == step
        assert r["epsilon"] == pytest.approx(_eps(1.0, step), rel=1e-9)
    tr.train()  # a second run on the same training set: composed
    tr.save_model()
    r = _strict_json(tmp_path / "out" / "privacy_report.json")
    both = compose(subsample(Gaussian(1.0), rate=B / N), steps=4).epsilon(1e-5)
    assert r["epsilon"] == pytest.approx(both, rel=1e-9)
    assert [run["steps"] for run in (*r["earlier_runs"], r["mechanism"])] == [2, 2]


def test_report_of_a_run_without_noise_is_strict_json(tmp_path):
    tr = DPTrainer(model=_gpt2(), args=_args(tmp_path, max_steps=1), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=float("inf"),
                                            seed=0))
    tr.train()
    tr.save_model(str(tmp_path / "release"))
    r = _strict_json(tmp_path / "release" / "privacy_report.json")
    assert r["epsilon"] == "inf" and r["mechanism"]["max_grad_norm"] == "inf"


def test_only_the_process_that_saves_writes_the_report(tmp_path, monkeypatch):
    """Under several processes only the one that writes the weights (should_save: the
    main process) writes the report."""
    tr = DPTrainer(model=_gpt2(), args=_args(tmp_path, max_steps=1), train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    tr.train()
    monkeypatch.setattr(type(tr.args), "should_save", property(lambda self: False))
    tr.save_model(str(tmp_path / "other-rank"))
    assert not (tmp_path / "other-rank" / "privacy_report.json").exists()


def test_resuming_a_run_whose_budget_is_spent_is_refused_before_any_batch(tmp_path):
    cap = (_eps(1.0, 2) + _eps(1.0, 3)) / 2  # room for exactly 2 steps
    privacy = PrivacyArguments(noise_multiplier=1.0, max_epsilon=cap, seed=0)
    args = _args(tmp_path / "out", max_steps=2, save_strategy="steps", save_steps=2)
    DPTrainer(model=_gpt2(), args=args, train_dataset=_TextSet(), privacy=privacy,
              private_state_dir=str(tmp_path / "private")).train()
    model = _gpt2()
    forwards = _count_forwards(model)
    tr = DPTrainer(model=model, args=args, train_dataset=_TextSet(), privacy=privacy,
                   private_state_dir=str(tmp_path / "private"))
    with pytest.raises(PrivacyBudgetExceededError, match="is spent.*no batch was drawn"):
        tr.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert not forwards and tr.privacy_engine.accountant.steps == 2


def test_report_merges_consecutive_steps_of_the_same_cost_and_keeps_the_epsilon():
    """Steps whose bound changes (adaptive clipping) but not their noise multiplier or
    rate are one entry with their count; a change of noise starts a new one. The entries
    describe exactly the accountant's mechanism (same composition, same epsilon)."""
    from privlearn.torch._hf_release import report_segments
    from privlearn.torch.accountant import PrivacyAccountant, Segment
    from privlearn.torch.schedule import compose_steps

    acc = PrivacyAccountant()
    q = 0.01
    for sigma, bound in [(1.0, 0.5), (1.0, 0.6), (1.0, 0.6), (1.0, 0.4), (0.8, 0.4),
                         (0.8, 0.7), (1.0, 0.7), (1.0, 0.7)]:
        acc.record_step(sigma, q, bound)
    assert len(acc.segments) == 6  # the accountant's history: one per change of anything
    entries = report_segments(acc.segments)
    assert entries == [
        {"noise_multiplier": 1.0, "sampling_rate": q, "max_grad_norm": 0.4, "steps": 4,
         "max_grad_norm_range": [0.4, 0.6]},
        {"noise_multiplier": 0.8, "sampling_rate": q, "max_grad_norm": 0.7, "steps": 2,
         "max_grad_norm_range": [0.4, 0.7]},
        {"noise_multiplier": 1.0, "sampling_rate": q, "max_grad_norm": 0.7, "steps": 2},
    ]
    rebuilt = [Segment(e["noise_multiplier"], e["sampling_rate"], e["max_grad_norm"],
                       e["steps"]) for e in entries]
    assert compose_steps(rebuilt, acc.scheme) == acc.mechanism()
    assert compose_steps(rebuilt, acc.scheme).epsilon(1e-5) == acc.epsilon(1e-5)


def test_adaptive_clipping_report_is_one_entry_not_one_per_step(tmp_path):
    """A run of adaptive clipping (the bound moves every step, so the accountant records a
    segment per step) is reported as one entry of all its steps, with the range of the
    bounds it used; the report's epsilon is the closed-form composition."""
    steps = 5
    tr = DPTrainer(model=_gpt2(), args=_args(tmp_path / "out", max_steps=steps),
                   train_dataset=_TextSet(),
                   privacy=PrivacyArguments(noise_multiplier=0.2, max_grad_norm=1e-4,
                                            clipping="adaptive",
                                            target_unclipped_quantile=0.5, seed=0))
    tr.train()
    segs = tr.privacy_engine.accountant.segments
    assert len(segs) == steps  # every step clipped everything: the bound grew each step
    tr.save_model(str(tmp_path / "release"))
    r = _strict_json(tmp_path / "release" / "privacy_report.json")
    bounds = [s.max_grad_norm for s in segs]
    assert r["mechanism"]["segments"] == [
        {"noise_multiplier": 0.2, "sampling_rate": B / N, "max_grad_norm": bounds[-1],
         "steps": steps, "max_grad_norm_range": [min(bounds), max(bounds)]}]
    assert r["mechanism"]["max_grad_norm"] == bounds[-1]
    assert r["epsilon"] == tr.epsilon()
    assert r["epsilon"] == pytest.approx(_eps(0.2, steps), rel=1e-9)


def _epsilon_of_the_report(r) -> float:
    """The epsilon a reader recomputes from the report's own entries: every run's
    segments (earlier runs, then the latest), composed (Abadi et al. 2016, Sec. 3.1)."""
    mechs, counts = [], []
    for run in (*r["earlier_runs"], r["mechanism"]):
        assert run["scheme"] == "poisson"
        for e in run["segments"]:
            mechs.append(subsample(Gaussian(e["noise_multiplier"]), rate=e["sampling_rate"]))
            counts.append(e["steps"])
    return compose(mechs, steps=counts).epsilon(r["delta"])


def test_a_resumed_run_reports_the_runs_its_epsilon_composes(tmp_path):
    """A trainer's second run (model_init) checkpoints, and a new trainer resumes it: the
    accountant's history carries the first run (epsilon 3 steps), and so does the report,
    so its epsilon is the composition of its own entries (the first run was dropped from
    the resumed run's report: 2.20 recomputed for 2.42 reported)."""
    def trainer(**kw):
        return DPTrainer(args=_args(tmp_path / "out", max_steps=2, save_strategy="steps",
                                    save_steps=1),
                         train_dataset=_TextSet(), private_state_dir=str(tmp_path / "private"),
                         privacy=PrivacyArguments(noise_multiplier=1.0, seed=0), **kw)

    first = trainer(model_init=lambda: _gpt2())
    first.args.max_steps = 1
    first.train()
    first.args.max_steps = 2
    first.train()  # writes checkpoint-1 and -2 of the second run (one earlier run)
    resumed = trainer(model=_gpt2())
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    resumed.save_model(str(tmp_path / "release"))
    r = _strict_json(tmp_path / "release" / "privacy_report.json")
    assert r["epsilon"] == pytest.approx(_eps(1.0, 3), rel=1e-9)
    assert [run["steps"] for run in (*r["earlier_runs"], r["mechanism"])] == [1, 2]
    assert _epsilon_of_the_report(r) == pytest.approx(r["epsilon"], rel=1e-9)
