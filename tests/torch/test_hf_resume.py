"""Resuming a DPTrainer checkpoint with other PrivacyArguments (privlearn.torch._hf_resume).

A resumed run continues the run that wrote the checkpoint. Settings the engine's mechanism
check does not see were silently taken over: another ``target_delta`` (every later epsilon
logged at another delta than the checkpoint's history), another ``max_epsilon`` (the stop
moved half-way), another ``secure_mode``. Each is refused before anything runs, naming the
setting. ``dp_seed`` may differ (a resumed run continues the checkpoint's streams); it is
never written into the released checkpoint folder."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from privlearn.errors import ConfigurationError  # noqa: E402
from privlearn.torch.hf import PRIVACY_STATE_NAME, DPTrainer, PrivacyArguments  # noqa: E402

V, T, N, B = 48, 8, 32, 8
SEED = 918273


def _text_set():  # the training set of these tests
    from hf_models import TokenSet

    return TokenSet(N, T, V)


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _trainer(out, private, privacy, max_steps):
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=B, max_steps=max_steps,
        learning_rate=0.05, logging_steps=1, save_strategy="steps", save_steps=2,
        report_to=[], use_cpu=True, lr_scheduler_type="constant", disable_tqdm=True,
        dataloader_pin_memory=False)
    return DPTrainer(model=_gpt2(), args=args, train_dataset=_text_set(), privacy=privacy,
                     private_state_dir=str(private))


BASE = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5,
                        seed=SEED)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    _trainer(tmp / "out", tmp / "private", BASE, 2).train()
    return tmp


@pytest.mark.parametrize("change", [{"target_delta": 1e-6}, {"max_epsilon": 50.0},
                                    {"secure_mode": True, "seed": None}],
                         ids=["target_delta", "max_epsilon", "secure_mode"])
def test_other_privacy_arguments_are_refused_before_anything_runs(checkpoint, change):
    name = next(iter(change))
    tr = _trainer(checkpoint / "out", checkpoint / "private",
                  dataclasses.replace(BASE, **change), 4)
    with pytest.raises(ConfigurationError, match=rf"{name}: .*same PrivacyArguments") as e:
        tr.train(resume_from_checkpoint=str(checkpoint / "out" / "checkpoint-2"))
    assert str(SEED) not in str(e.value)  # the seed replays the noise: never shown
    assert "saved" in str(e.value) and "given" in str(e.value)
    assert tr.privacy_engine is None and tr.state.global_step == 0


def test_the_same_arguments_and_the_free_ones_resume_to_the_uninterrupted_epsilon(
        checkpoint, tmp_path):
    # the seed (the checkpoint's streams continue), the task and the probe may change
    free = dataclasses.replace(BASE, seed=SEED + 1, task="causal_lm",
                               check_batch_independence=False)
    tr = _trainer(checkpoint / "out", checkpoint / "private", free, 4)
    tr.train(resume_from_checkpoint=str(checkpoint / "out" / "checkpoint-2"))
    whole = _trainer(tmp_path / "out", tmp_path / "private", BASE, 4)
    whole.train()
    assert tr.privacy_engine.accountant.steps == 4
    assert tr.epsilon() == pytest.approx(whole.epsilon(), rel=1e-12)
    for a, b in zip(tr.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_seed_is_not_in_the_released_checkpoint(checkpoint):
    state = torch.load(checkpoint / "out" / "checkpoint-2" / PRIVACY_STATE_NAME,
                       weights_only=False)
    assert state["privacy_arguments"]["target_delta"] == 1e-5
    assert "dp_seed" not in state["privacy_arguments"]
    assert str(SEED) not in repr(state)


def test_a_checkpoint_of_another_number_of_processes_is_refused_as_such(checkpoint, tmp_path):
    """A checkpoint written by two processes (one privacy state per rank) resumed in one
    process was refused as "not written by DPTrainer": now the numbers of processes are
    named (each rank continues its own sampler and noise), before anything runs."""
    import shutil

    folder = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint / "out" / "checkpoint-2", folder)
    state = folder / PRIVACY_STATE_NAME
    for r in range(2):
        shutil.copy(state, folder / f"privlearn_privacy.rank{r}.pt")
    state.unlink()
    tr = _trainer(tmp_path / "out", checkpoint / "private", BASE, 4)
    with pytest.raises(ConfigurationError, match=r"run of 2 process.*this run has 1"):
        tr.train(resume_from_checkpoint=str(folder))
    assert tr.privacy_engine is None and tr.state.global_step == 0


def _user_text_set():
    """The training set with a user column: 8 users of 4 sequences."""
    from hf_models import UserColumn
    return UserColumn(_text_set(), 4)


def test_the_grouping_into_users_is_kept_out_of_the_released_checkpoint(tmp_path):
    """A user-level run's checkpoint folder held, in its privacy state, a digest of which
    examples each user holds (un-noised: who is in the data, with how many examples, can
    be tested against it), also in secure mode without a private folder. Now the folder
    holds the number of users only, the grouping goes to the private state (required
    for a user-level run that checkpoints, secure mode too), and resuming still checks
    it and continues to the uninterrupted epsilon."""
    users = dataclasses.replace(BASE, user_column="user", max_examples_per_user=2)

    def trainer(out, private, privacy, steps):
        tr = _trainer(out, private, privacy, steps)
        tr.train_dataset = _user_text_set()
        return tr

    trainer(tmp_path / "out", tmp_path / "private", users, 2).train()
    public = torch.load(tmp_path / "out" / "checkpoint-2" / PRIVACY_STATE_NAME,
                        weights_only=False)
    assert public["mechanism"]["users"] == "8 users"
    assert "partition" not in repr(public) and "sha256" not in repr(public)
    resumed = trainer(tmp_path / "out", tmp_path / "private", users, 4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    whole = trainer(tmp_path / "whole", tmp_path / "private2", users, 4)
    whole.train()
    assert resumed.privacy_engine.accountant.steps == 4
    assert resumed.epsilon() == pytest.approx(whole.epsilon(), rel=1e-12)
    secure = dataclasses.replace(users, secure_mode=True, seed=None)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "s"), per_device_train_batch_size=B, max_steps=2,
        save_strategy="steps", save_steps=2, report_to=[], use_cpu=True)
    with pytest.raises(ConfigurationError, match="private_state_dir is required.*users"):
        DPTrainer(model=_gpt2(), args=args, train_dataset=_user_text_set(), privacy=secure)


@pytest.mark.parametrize("sampling", [
    "balls_in_bins",
    pytest.param("shuffled_epochs", marks=pytest.mark.slow),
    pytest.param("cyclic_poisson", marks=pytest.mark.slow)])
def test_a_secure_run_resumed_mid_epoch_keeps_its_layout(sampling, tmp_path, monkeypatch):
    """secure_mode draws the layout (bins, order, groups) from the OS CSPRNG: the
    checkpoint keeps it (no private folder needed), and the resumed run follows it, so
    over the whole run every example takes part only in steps of one residue mod
    cycle_length (a new layout would put examples in two bins of one epoch)."""
    from privlearn.torch import samplers

    drawn: list = []
    iterate = samplers._AccountedSampler._iterate

    def recorded(self, fifo):
        for batch in iterate(self, fifo):
            drawn.append((self._step, list(batch)))
            yield batch

    monkeypatch.setattr(samplers._AccountedSampler, "_iterate", recorded)
    cycle = 4
    pa = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5,
                          sampling=sampling, cycle_length=cycle, secure_mode=True)
    args = dict(per_device_train_batch_size=B, learning_rate=0.05, save_strategy="steps",
                save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True,
                dataloader_pin_memory=False, output_dir=str(tmp_path / "out"))
    DPTrainer(model=_gpt2(), args=transformers.TrainingArguments(max_steps=2, **args),
              train_dataset=_text_set(), privacy=pa).train()
    public = torch.load(tmp_path / "out" / "checkpoint-2" / PRIVACY_STATE_NAME,
                        weights_only=True)
    assert "dataset" not in public["sampler"]  # its digest of the data is no release
    resumed = DPTrainer(model=_gpt2(), args=transformers.TrainingArguments(
        max_steps=2 * cycle, **args), train_dataset=_text_set(), privacy=pa)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.privacy_engine.accountant.steps == 2 * cycle
    steps = dict(drawn)  # each step's batch (a batch drawn again for a step: the same)
    assert sorted(steps) == list(range(2 * cycle))
    residues: dict = {}
    for step, batch in steps.items():
        for i in batch:
            residues.setdefault(i, set()).add(step % cycle)
    assert all(len(r) == 1 for r in residues.values()), residues
