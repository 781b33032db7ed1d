"""DPTrainer with ``gradient_accumulation_steps = k`` (privlearn.torch._hf_accumulate).

The logical batch (expected ``B k`` rows per process) is what the DP sampler draws, what
is clipped per example, noised once and accounted as one step at ``q = B k W / N``; it
is trained in physical chunks of at most ``B`` rows. Checks: (a) noise off, one step
equals the naive loop of batch-of-one clipped gradients over the whole logical batch
recorded by the collator, each forward pass of at most ``B`` rows; (b) noise on, the
run equals the one with ``k = 1`` and ``per_device_train_batch_size = B k`` (same seed:
the same batches and noise), so the same parameters, epsilon, accountant history,
learning rates and logged losses; (c) ``num_train_epochs`` and ``target_epsilon`` plan
logical steps; (d) a resumed run continues the uninterrupted one; (e) the peak memory of
a step follows the chunk, not the logical batch. Distributed: test_hf_distributed.py."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch import per_sequence_cross_entropy  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402

V, T, N = 97, 7, 48


def _gpt2(seed=0):
    from hf_models import build

    return build("gpt2", dtype=torch.float32, seed=seed)


def _data(n=N, t=T):
    from hf_models import TokenSet

    return TokenSet(n, t, V)


def _args(out, b, k, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=b,
                gradient_accumulation_steps=k, max_steps=3, learning_rate=0.05,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                lr_scheduler_type="linear", disable_tqdm=True, dataloader_pin_memory=False)
    base.update(kw)
    return transformers.TrainingArguments(**base)


class _Forwards(DPTrainer):
    """Records the rows of every forward pass of a training step."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.rows.append(inputs["input_ids"].shape[0])
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_an_accumulated_step_equals_the_naive_clipped_loop_over_the_logical_batch(
        tmp_path, oracle):
    """sigma = 0, a bound below every example's norm, SGD, B = 4, k = 3: the one Poisson
    batch drawn at q = 12 / 48 (recorded by the collator: more than B rows) is trained
    in forward passes of at most 4 rows, and the update is lr / 12 times the sum of its
    examples' gradients, each computed alone and clipped; one step is accounted, at the
    logical rate."""
    from test_hf_trainer import _recording_collate

    b, k, c, lr = 4, 3, 1e-3, 1.0
    model, ref = _gpt2(), _gpt2()
    seen = []
    with pytest.warns(UserWarning, match="compute_loss overrides"):
        tr = _Forwards(model=model, args=_args(tmp_path, b, k, max_steps=1,
                                               learning_rate=lr),
                       train_dataset=_data(), data_collator=_recording_collate(seen),
                       optimizers=(torch.optim.SGD(model.parameters(), lr=lr), None),
                       privacy=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=c,
                                                seed=5))
    tr.rows = []
    tr.train()
    batch = seen[-1]  # the logical batch the sampler drew
    n = batch["input_ids"].shape[0]
    assert n > 2 * b  # three chunks at least
    probe = sum(tr.rows) - n  # the start-up check of compute_loss on a few examples
    steps = tr.rows[-math.ceil(n / b):]
    assert sum(steps) == n and max(steps) <= b and probe >= 0
    params = list(ref.parameters())

    def loss(i):
        out = ref(input_ids=batch["input_ids"][i:i + 1],
                  attention_mask=batch["attention_mask"][i:i + 1])
        return per_sequence_cross_entropy(out.logits, batch["labels"][i:i + 1], shift=True)

    rows = oracle.grads(loss, n, params)
    assert (rows.norm(dim=1) > c).all()  # every example clipped: the bound is compared
    total, _ = oracle.clip_and_sum(rows, c)
    oracle.sgd_step(params, total, lr, b * k)
    torch.testing.assert_close(oracle.flat(model.parameters()), oracle.flat(params),
                               rtol=1e-4, atol=1e-8)
    acct = tr.privacy_engine.accountant
    assert acct.steps == 1 and [s.sampling_rate for s in acct.segments] == [b * k / N]
    assert tr.state.global_step == 1


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two runs of 3 steps, the same seed, noise on, a linear learning-rate schedule:
    B = 4 with k = 3, and B = 12 with k = 1."""
    tmp = tmp_path_factory.mktemp("accumulate")
    runs = {}
    for b, k in ((4, 3), (12, 1)):
        args = _args(tmp / f"{b}x{k}", b, k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = DPTrainer(model=_gpt2(), args=args, train_dataset=_data(),
                           privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5,
                                                    seed=11, log_training_loss=True))
            tr.train()
        runs[k] = tr
    return runs


def test_the_run_is_the_run_of_the_whole_logical_batch_per_device(pair):
    """The same seed draws the same logical batches and noise: k = 3 chunks of B = 4
    train to the parameters of B = 12 in one pass; the learning rate steps once per
    logical step; the logged loss is the mean over the logical batch."""
    acc, whole = pair[3], pair[1]
    for (name, u), v in zip(acc.model.named_parameters(), whole.model.parameters(),
                            strict=True):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-6, msg=name)
    logs = [[(h["step"], h["learning_rate"], h["loss"]) for h in t.state.log_history
             if "loss" in h] for t in (acc, whole)]
    assert [s for s, _, _ in logs[0]] == [1, 2, 3]
    assert [lr for _, lr, _ in logs[0]] == [lr for _, lr, _ in logs[1]]
    assert logs[0][0][1] > logs[0][1][1] > logs[0][2][1] > 0  # linear decay over 3 steps
    for (_, _, a), (_, _, b) in zip(*logs, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert acc.state.global_step == whole.state.global_step == 3


def test_one_accounted_step_per_logical_batch_at_the_logical_rate(pair):
    acc, whole = pair[3], pair[1]
    q = 12 / N
    want = compose(subsample(Gaussian(1.0), rate=q), steps=3).epsilon(1e-5)
    assert acc.privacy_engine.accountant.steps == 3
    assert acc.privacy_engine.sampling_rate == pytest.approx(q)
    assert acc.privacy_engine.accountant.segments == whole.privacy_engine.accountant.segments
    assert acc.epsilon() == whole.epsilon() == pytest.approx(want, rel=1e-9)
    logged = [h["epsilon"] for h in acc.state.log_history if "loss" in h]
    assert logged == [h["epsilon"] for h in whole.state.log_history if "loss" in h]


def test_the_arguments_say_the_given_accumulation(pair, tmp_path):
    """The Trainer counts one item per logical batch while it trains; the trainer's
    arguments say the given k again after it, and the Trainer's effective batch is
    B k W."""
    acc = pair[3]
    assert acc.args.gradient_accumulation_steps == 3
    assert acc.gradient_accumulation_steps == 3
    assert acc.get_total_train_batch_size(acc.args) == 12
    acc.save_model(str(tmp_path / "saved"))
    saved = torch.load(tmp_path / "saved" / "training_args.bin", weights_only=False)
    assert saved.gradient_accumulation_steps == 3


class _Records(transformers.TrainerCallback):
    """What a logging integration records of the arguments (TensorBoard writes
    ``args.to_json_string()``; W&B, MLflow, Comet log ``args.to_dict()``), at each event."""

    def __init__(self):
        self.seen = []

    def _record(self, event, args):
        import json

        self.seen.append((event, args.gradient_accumulation_steps,
                          args.to_dict()["gradient_accumulation_steps"],
                          args.to_sanitized_dict()["gradient_accumulation_steps"],
                          json.loads(args.to_json_string())["gradient_accumulation_steps"]))

    def on_train_begin(self, args, state, control, **kwargs):
        self._record("on_train_begin", args)

    def on_step_end(self, args, state, control, **kwargs):
        self._record("on_step_end", args)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._record("on_log", args)


def test_callbacks_record_the_given_accumulation(tmp_path):
    """Experiment trackers record the arguments in their callbacks: every event of a run
    with k = 3 sees gradient_accumulation_steps = 3 (in the attribute and in to_dict,
    to_sanitized_dict and to_json_string), while the Trainer still steps once per
    logical batch."""
    rec = _Records()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DPTrainer(model=_gpt2(), args=_args(tmp_path, 4, 3, max_steps=2),
                       train_dataset=_data(), callbacks=[rec],
                       privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5,
                                                seed=3))
        tr.train()
    events = [e for e, *_ in rec.seen]
    assert events[0] == "on_train_begin"
    assert events.count("on_step_end") == 2 and "on_log" in events
    assert all(v == [3, 3, 3, 3] for _, *v in rec.seen), rec.seen
    assert tr.state.global_step == 2 and tr.privacy_engine.accountant.steps == 2
    assert tr.args.gradient_accumulation_steps == 3


@pytest.mark.parametrize("plan", ["epochs", "target_epsilon"])
def test_epochs_and_target_epsilon_plan_logical_steps(tmp_path, plan):
    """num_train_epochs = 1 at q = B k / N = 8 / 32 is 4 logical steps (not 8 chunks);
    target_epsilon calibrates sigma for them, as for k = 1 with B k."""
    kw = dict(max_steps=-1, num_train_epochs=1)
    pa = (PrivacyArguments(noise_multiplier=1.0, seed=0) if plan == "epochs" else
          PrivacyArguments(target_epsilon=3.0, seed=0))
    runs = []
    for b, k in ((2, 4), (8, 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = DPTrainer(model=_gpt2(), args=_args(tmp_path / str(k), b, k, **kw),
                           train_dataset=_data(n=32), privacy=pa)
            tr.train()
        runs.append(tr)
    acc, whole = runs
    assert acc.state.global_step == acc.privacy_engine.accountant.steps == 4
    assert acc.privacy_engine.noise_multiplier == whole.privacy_engine.noise_multiplier
    assert acc.epsilon() == whole.epsilon()
    assert acc.state.epoch == pytest.approx(1.0)


def test_a_resumed_accumulating_run_continues_the_uninterrupted_one(tmp_path):
    """Checkpoints at steps 2 and 4 of a k = 2 run; resumed from step 2 (another seed
    and other weights), it ends with the uninterrupted run's parameters and epsilon."""
    pa = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5, seed=7)

    def trainer(seed, model_seed):
        args = _args(tmp_path / "out", 3, 2, max_steps=4, save_strategy="steps",
                     save_steps=2)
        return DPTrainer(model=_gpt2(model_seed), args=args, train_dataset=_data(),
                         privacy=PrivacyArguments(**{**_fields(pa), "dp_seed": seed}),
                         private_state_dir=str(tmp_path / "private"))

    a = trainer(7, 0)
    a.train()
    b = trainer(99, 1)
    b.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert b.privacy_engine.accountant.steps == 4
    assert b.epsilon() == a.epsilon()
    for (name, u), v in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0, msg=name)
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / "training_args.bin",
                       weights_only=False)
    assert saved.gradient_accumulation_steps == 2


def _fields(pa):
    import dataclasses

    return {f.name: getattr(pa, f.name) for f in dataclasses.fields(pa)}


def test_a_logical_batch_larger_than_the_training_set_is_refused(tmp_path):
    tr = DPTrainer(model=_gpt2(), args=_args(tmp_path, 8, 8), train_dataset=_data(n=32),
                   privacy=PrivacyArguments(noise_multiplier=1.0))
    with pytest.raises(ConfigurationError, match=r"gradient_accumulation_steps=8 .* global "
                       r"batch of 64 .*per_device_train_batch_size \* "
                       r"gradient_accumulation_steps must be at most 32"):
        tr.train()
    assert tr.state.global_step == 0


def test_accumulation_under_fsdp2_is_refused_when_the_trainer_is_built(tmp_path,
                                                                        monkeypatch):
    """FSDP2 runs collectives in every pass; a rank's number of chunks is its own."""
    from privlearn.torch import _hf_refuse

    monkeypatch.setattr(_hf_refuse, "is_fsdp2", lambda trainer: True)
    with pytest.raises(ConfigurationError, match=r"gradient_accumulation_steps=2 .*FSDP2.*"
                       r"per_device_train_batch_size of 8"):
        DPTrainer(model=_gpt2(), args=_args(tmp_path, 4, 2), train_dataset=_data(),
                  privacy=PrivacyArguments(noise_multiplier=1.0))


def test_user_level_chunks_hold_whole_users(tmp_path):
    """A user column, users of 3 sequences, all 3 trained on: chunks of at most
    B * max_examples_per_user = 6 rows (the most B users bring), each user's rows in one
    chunk (clipped together); the run equals the one with k = 1 and B k users."""
    from hf_models import UserColumn
    from test_hf_trainer import _recording_collate

    runs, seen = [], []
    for b, k in ((2, 3), (6, 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = DPTrainer(model=_gpt2(), args=_args(tmp_path / str(k), b, k),
                           train_dataset=UserColumn(_data(), 3),
                           data_collator=_recording_collate(seen),
                           privacy=PrivacyArguments(noise_multiplier=1.0, seed=2,
                                                    user_column="user",
                                                    max_examples_per_user=3))
            tr.train()
        runs.append(tr)
    acc, whole = runs
    assert max(x["input_ids"].shape[0] for x in seen) > 6  # trained in several chunks
    assert acc.epsilon() == whole.epsilon()
    assert acc.privacy_engine.sampling_rate == pytest.approx(6 / 16)
    for u, v in zip(acc.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-6)


def _step_peaks(tmp_path, b, k, t=32):
    """Peak live CPU tensor bytes of each training step (the forward and backward passes
    of its chunks, the accumulation of their clipped sums) over those live before it,
    fixed-size logical batches of B k rows of ``t`` tokens."""
    from torch.profiler import ProfilerActivity, profile

    peaks = []

    class Measured(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = super().training_step(model, inputs, num_items_in_batch)
            events = sorted((e.start_ns(), e.nbytes())
                            for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"
                            and e.device_type() == torch.autograd.DeviceType.CPU)
            live = peak = 0
            for _, nbytes in events:
                live += nbytes
                peak = max(peak, live)
            peaks.append(peak)
            return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Measured(model=_gpt2(), args=_args(tmp_path / f"{b}x{k}", b, k, max_steps=2),
                 train_dataset=_data(n=64, t=t),
                 privacy=PrivacyArguments(noise_multiplier=1.0, seed=0,
                                          sampling="fixed")).train()
    return peaks[-1]  # the second step: the first also probes the model


def test_the_peak_memory_of_a_step_follows_the_chunk_not_the_logical_batch(tmp_path):
    """torch's CPU allocator peak of a training step (torch.profiler, profile_memory):
    logical batches of 16 in chunks of 4 take about what batches of 4 take (plus the
    parameter-sized sum kept between chunks), far less than batches of 16 in one pass."""
    chunk, logical, whole = (_step_peaks(tmp_path, 4, 1), _step_peaks(tmp_path, 4, 4),
                             _step_peaks(tmp_path, 16, 1))
    params = sum(p.numel() * 4 for p in _gpt2().parameters())
    assert whole > 3 * chunk  # the batch's activations dominate the step
    assert logical <= chunk + 2 * params
    assert logical < whole / 2



def test_empty_logical_batches_take_the_noise_only_step(tmp_path):
    """q = 1 x 2 / 16: among 12 logical batches some are empty (one chunk of no rows,
    no forward pass) and still take their step, accounted; the others of 1 to 3+ rows
    are trained in chunks of 1."""
    class Sizes(DPTrainer):
        sizes: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.sizes.append(inputs["input_ids"].shape[0])
            return super().training_step(model, inputs, num_items_in_batch)

    tr = Sizes(model=_gpt2(), args=_args(tmp_path, 1, 2, max_steps=12),
               train_dataset=_data(n=16),
               privacy=PrivacyArguments(noise_multiplier=1.0, seed=1))
    tr.train()
    assert len(tr.sizes) == 12 and 0 in tr.sizes and max(tr.sizes) > 1
    assert tr.state.global_step == tr.privacy_engine.accountant.steps == 12


def test_evaluation_is_that_of_the_trained_model(pair):
    """Evaluation runs as in any Trainer: the two runs (the same parameters) evaluate
    alike, on examples that are not training examples."""
    from hf_models import TokenSet

    held_out = TokenSet(8, T, V, seed=1)
    a, b = (t.evaluate(eval_dataset=held_out)["eval_loss"] for t in (pair[3], pair[1]))
    assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize("settings", [
    dict(clipping="adaptive", target_unclipped_quantile=0.5),
    dict(sampling="fixed"),
    pytest.param(dict(noise="banded", bands=2, sampling="cyclic_poisson", cycle_length=2),
                 marks=pytest.mark.slow),
], ids=["adaptive", "fixed", "banded"])
def test_other_mechanisms_run_as_with_the_whole_logical_batch(tmp_path, settings):
    """Adaptive clipping (the unclipped count summed over the chunks), fixed-size batches
    and correlated noise: k = 3 chunks of 4 is the run of B = 12 (same seed), the same
    parameters, epsilon and clipping bound."""
    runs = []
    for b, k in ((4, 3), (12, 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = DPTrainer(model=_gpt2(), args=_args(tmp_path / str(k), b, k,
                                                     lr_scheduler_type="constant"),
                           train_dataset=_data(),
                           privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5,
                                                    seed=3, **settings))
            tr.train()
        runs.append(tr)
    acc, whole = runs
    assert acc.privacy_engine.accountant.steps == 3
    assert acc.epsilon() == whole.epsilon()
    assert acc.privacy_engine.max_grad_norm == whole.privacy_engine.max_grad_norm
    for u, v in zip(acc.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-6)
