"""DPTrainer checkpoints: what continues the run's randomness stays out of the release.

A checkpoint folder is a release (``push_to_hub`` uploads it). The keys of the sampler and
of the noise replay the *next* steps' batches and noise, and correlated noise continues
from its last noises; with a model released later, either gives back an un-noised clipped
gradient. These tests check that none of it is written into ``output_dir``, that it is
written under ``private_state_dir`` and resumes exactly from there, and that every set-up
that would lose or leak it is refused with the reason."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_trainer import B, _args, _llama, _TextSet  # noqa: E402

from privlearn.torch.hf import PRIVACY_STATE_NAME, DPTrainer, PrivacyArguments  # noqa: E402
from privlearn.torch.noise import NoiseSource  # noqa: E402

# privacy_arguments: the public PrivacyArguments, compared on resume (dp_seed is not one);
# earlier_runs: the privacy report's descriptions of the trainer's runs before this one;
# ledger: the planned run's ledger reservations (entry numbers and hashes, no path), which
# a resume on that ledger takes over (None without a ledger)
_PUBLIC = {"format", "mechanism", "noise_multiplier", "max_grad_norm", "accountant", "budget",
           "private_state", "privacy_arguments", "earlier_runs", "ledger"}


def _banded(**kw):
    return PrivacyArguments(noise_multiplier=2.0, noise="banded", bands=3,
                            sampling="cyclic_poisson", cycle_length=3, seed=0, **kw)


def _private_file(private, checkpoint) -> str:
    token = torch.load(os.path.join(checkpoint, PRIVACY_STATE_NAME),
                       weights_only=False)["private_state"]["token"]
    return os.path.join(private, f"{os.path.basename(checkpoint)}.{token}.pt")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _released_tensors(folder):
    """Every tensor in every file of a checkpoint folder."""
    from safetensors.torch import load_file

    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            yield from load_file(path).values()
        elif name.endswith((".pt", ".pth", ".bin")):
            yield from _tensors(torch.load(path, weights_only=False))


def _flat(state, names):
    return torch.cat([state[n].flatten().double() for n in names])


def test_correlated_noise_state_is_kept_out_of_checkpoints_and_resumes(tmp_path):
    """Banded noise: the last noises were saved in every checkpoint folder (from two
    consecutive checkpoints and them the un-noised clipped sum of a step could be read).
    No tensor of any checkpoint file now holds them; they are in the private file, and a
    run resumed from checkpoint 2 ends bit for bit where the uninterrupted one did."""
    out, private = tmp_path / "out", tmp_path / "private"
    args = _args(out, max_steps=4, save_strategy="steps", save_steps=2)
    a = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(), privacy=_banded(),
                  private_state_dir=private)
    a.train()
    for step in (2, 4):
        ckpt = str(out / f"checkpoint-{step}")
        public = torch.load(os.path.join(ckpt, PRIVACY_STATE_NAME), weights_only=False)
        assert set(public) == _PUBLIC
        assert public["private_state"]["parts"] == ["correlated", "noise", "sampler"]
        secret = torch.load(_private_file(private, ckpt), weights_only=False)
        noises = secret["correlated"]["buffers"]
        assert noises.shape[0] == 2 and noises.abs().sum() > 0  # bands - 1 past noises
        for t in _released_tensors(ckpt):
            for row in (noises, *noises):
                assert not (t.numel() == row.numel()
                            and torch.equal(t.flatten().double(), row.flatten().double()))
    assert stat.S_IMODE(os.stat(_private_file(private, str(out / "checkpoint-4"))).st_mode) \
        == 0o600
    b = DPTrainer(model=_llama(seed=5), args=args, train_dataset=_TextSet(), privacy=_banded(),
                  private_state_dir=private)
    b.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert b.privacy_engine.accountant.steps == 4 and b.epsilon() == a.epsilon()
    for (name, u), v in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0, msg=name)


def test_noise_key_replays_the_next_step_so_it_stays_private(tmp_path):
    """DP-SGD (default mode): the noise key saved at checkpoint 1 replays step 2's noise;
    with checkpoint 2's model that left step 2's clipped sum without noise (norm at most
    batch x C <= N C, against a noise of norm ~ sigma C sqrt(d)). The key is now only in the
    private file, which indeed does this, and the checkpoint holds no key at all."""
    out, private = tmp_path / "out", tmp_path / "private"
    sigma, clip, lr = 4.0, 1.0, 0.1
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    tr = DPTrainer(model=model, args=_args(out, max_steps=2, save_strategy="steps",
                                           save_steps=1, learning_rate=lr),
                   train_dataset=_TextSet(), optimizers=(opt, None), private_state_dir=private,
                   privacy=PrivacyArguments(noise_multiplier=sigma, max_grad_norm=clip))
    tr.train()
    ckpt1, ckpt2 = str(out / "checkpoint-1"), str(out / "checkpoint-2")
    public = torch.load(os.path.join(ckpt1, PRIVACY_STATE_NAME), weights_only=False)
    assert set(public) == _PUBLIC | {"correlated"} and public["correlated"] is None
    assert public["private_state"]["parts"] == ["noise", "sampler"]

    from safetensors.torch import load_file

    p = tr.privacy_engine
    ids = {id(v): n for n, v in p.model.named_parameters()}
    names = [ids[id(q)] for q in p.optimizer.tracker.params]
    step2 = (_flat(load_file(os.path.join(ckpt1, "model.safetensors")), names)
             - _flat(load_file(os.path.join(ckpt2, "model.safetensors")), names)) / lr * B
    key = torch.load(_private_file(private, ckpt1), weights_only=False)["noise"]
    source = NoiseSource()
    source.load_state_dict(key)
    noise = source.fill_normal_(torch.empty(step2.numel()), sigma * clip).double()
    n = len(_TextSet())
    assert noise.norm() > 4 * n * clip  # the noise hides the sum ...
    assert (step2 - noise).norm() <= n * clip  # ... unless the key is known


def test_setups_that_would_leak_or_lose_the_secret_state_are_refused(tmp_path):
    out = tmp_path / "out"
    steps = _args(out, save_strategy="steps", save_steps=1)
    with pytest.raises(ValueError, match=r"private_state_dir is required.*last noises.*"
                                         r"save_strategy='no'") as e:
        DPTrainer(model=_llama(), args=steps, train_dataset=_TextSet(), privacy=_banded())
    assert "secure_mode" not in str(e.value)  # it has no keys but still needs the noises
    with pytest.raises(ValueError, match=r"private_state_dir is required.*keys.*"
                                         r"secure_mode=True"):
        DPTrainer(model=_llama(), args=steps, train_dataset=_TextSet(),
                  privacy=PrivacyArguments(noise_multiplier=1.0))
    with pytest.raises(ValueError, match="inside output_dir"):  # what push_to_hub uploads
        DPTrainer(model=_llama(), args=steps, train_dataset=_TextSet(), privacy=_banded(),
                  private_state_dir=out / "private")
    # nothing to keep, or nothing saved: accepted without a private folder
    DPTrainer(model=_llama(), args=_args(out), train_dataset=_TextSet(), privacy=_banded())
    DPTrainer(model=_llama(), args=steps, train_dataset=_TextSet(),
              privacy=PrivacyArguments(noise_multiplier=1.0, secure_mode=True))


def test_resume_refuses_a_checkpoint_whose_secret_state_is_missing(tmp_path):
    out, private = tmp_path / "out", tmp_path / "private"
    args = _args(out, max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1)
    a = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(), privacy=_banded(),
                  private_state_dir=private)
    a.train()
    # save_total_limit=1: checkpoint-1 was deleted, and its private file with it
    assert sorted(os.listdir(out)) == ["checkpoint-2"]
    ckpt = str(out / "checkpoint-2")
    assert os.listdir(private) == [os.path.basename(_private_file(private, ckpt))]

    fresh = DPTrainer(model=_llama(), args=_args(out, max_steps=2), train_dataset=_TextSet(),
                      privacy=_banded())  # saves nothing: no private folder needed
    with pytest.raises(ValueError, match=r"private_state_dir=\.\.\.\) naming the folder"):
        fresh.train(resume_from_checkpoint=ckpt)
    elsewhere = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(),
                          privacy=_banded(), private_state_dir=tmp_path / "other")
    with pytest.raises(ValueError, match="is not in private_state_dir"):
        elsewhere.train(resume_from_checkpoint=ckpt)
    assert fresh.state.global_step == 0 and elsewhere.state.global_step == 0
    assert fresh.privacy_engine is None and elsewhere.privacy_engine is None


def test_a_checkpoint_forced_without_a_private_folder_keeps_no_secret(tmp_path):
    """save_strategy='no' needs no private folder; a callback that saves anyway gets a
    checkpoint without the secret part, which cannot be resumed (said so)."""

    class SaveAtEnd(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_save = True

    out = tmp_path / "out"
    tr = DPTrainer(model=_llama(), args=_args(out, max_steps=1), train_dataset=_TextSet(),
                   privacy=_banded(), callbacks=[SaveAtEnd()])
    tr.train()
    ckpt = str(out / "checkpoint-1")
    public = torch.load(os.path.join(ckpt, PRIVACY_STATE_NAME), weights_only=False)
    assert set(public) == _PUBLIC and public["private_state"]["kept"] is False
    resumed = DPTrainer(model=_llama(), args=_args(out, max_steps=2), train_dataset=_TextSet(),
                        privacy=_banded(), private_state_dir=tmp_path / "private")
    with pytest.raises(ValueError, match="saved without a private_state_dir"):
        resumed.train(resume_from_checkpoint=ckpt)


def test_secure_mode_checkpoints_hold_no_key_and_resume_without_a_private_folder(tmp_path):
    out = tmp_path / "out"
    pa = PrivacyArguments(noise_multiplier=1.0, secure_mode=True)
    args = _args(out, max_steps=2, save_strategy="steps", save_steps=1)
    DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(), privacy=pa).train()
    public = torch.load(out / "checkpoint-1" / PRIVACY_STATE_NAME, weights_only=False)
    assert public["private_state"] is None
    assert public["sampler"]["key"] is None and public["noise"]["replayable"] is False
    b = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(), privacy=pa)
    b.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert b.privacy_engine.accountant.steps == 2


def test_the_privacy_state_goes_to_the_checkpoint_this_run_wrote(tmp_path):
    """A hyperparameter search writes output_dir/run-<id>/checkpoint-N; a folder of the
    same name left by an earlier run is never given this run's state."""
    import os
    import time

    from privlearn.torch.hf import checkpoint_folder

    def ckpt(path, age):
        path.mkdir(parents=True)
        f = path / "trainer_state.json"
        f.write_text("{}")
        t = time.time() - age
        os.utime(f, (t, t))
        return str(path)

    stale = ckpt(tmp_path / "checkpoint-4", age=3600)
    started = time.time() - 5
    assert checkpoint_folder(tmp_path, 4, started) is None
    fresh = ckpt(tmp_path / "run-1" / "checkpoint-4", age=0)
    assert checkpoint_folder(tmp_path, 4, started) == fresh != stale
    assert checkpoint_folder(tmp_path, 5, started) is None


class _Lengths(torch.utils.data.Dataset):
    """Token sequences of private lengths 2 to 4, or ``T`` for row ``long_row``."""

    def __init__(self, long_row=None):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 48, (64, 10), generator=g)
        self.lengths = torch.randint(2, 5, (64,), generator=g)
        if long_row is not None:
            self.lengths[long_row] = 10

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = self.ids[i, : int(self.lengths[i])]
        return {"input_ids": ids, "labels": ids}


def _pad(rows):
    """Padding to the longest row of the batch (as DataCollatorWithPadding does)."""
    t = max([len(r["input_ids"]) for r in rows], default=1)
    ids, mask = torch.zeros(len(rows), t, dtype=torch.long), torch.zeros(len(rows), t,
                                                                         dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])], mask[i, : len(r["input_ids"])] = r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def test_global_generator_states_stay_out_of_checkpoints(tmp_path):
    """Dropout draws one number per element of the padded batch, so how far torch's
    generator advanced follows the private batch sizes and sequence lengths; the Trainer
    saved its state (``rng_state.pth``) in every checkpoint folder. Two neighbouring
    training sets (one row made longer), the same seeds: every file of the checkpoint but
    the accounted ones (the model, the optimizer's state, the privacy state with its random
    token) is now byte for byte the same. The states go to the private file, and a run
    resumed from it (dropout on) ends bit for bit where the uninterrupted one did."""
    out, private = tmp_path / "out", tmp_path / "private"
    args = _args(out, max_steps=4, save_strategy="steps", save_steps=2)
    pa = PrivacyArguments(noise_multiplier=1.0, seed=0)
    accounted = {"model.safetensors", "optimizer.pt", PRIVACY_STATE_NAME}

    def train(data, model=None, **kw):
        tr = DPTrainer(model=model or _llama(dropout=0.5), args=args, train_dataset=data,
                       data_collator=_pad, privacy=pa, private_state_dir=private)
        tr.train(**kw)
        return tr

    released = []
    for long_row in (7, None):  # row 7 is in the second batch of this seed
        train(_Lengths(long_row))
        ckpt = out / "checkpoint-2"
        released.append({f: (ckpt / f).read_bytes() for f in os.listdir(ckpt)
                         if f not in accounted})
        if long_row is not None:
            shutil.rmtree(out)
            shutil.rmtree(private)
    assert released[0].keys() == released[1].keys()
    differ = [f for f in released[0] if released[0][f] != released[1][f]]
    assert not differ, f"released checkpoint files depend on the private data: {differ}"
    assert not any(f.startswith("rng_state") for f in released[0])
    assert torch.load(_private_file(private, str(ckpt)), weights_only=False)["rng"]["cpu"].numel()
    a = train(_Lengths())  # the same run again (the same files), and one resumed
    b = train(_Lengths(), model=_llama(seed=5, dropout=0.5), resume_from_checkpoint=str(ckpt))
    for (name, u), v in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0, msg=name)


def test_private_files_follow_the_checkpoints_the_trainer_keeps_at_the_end(tmp_path):
    """``save_total_limit=1`` with ``load_best_model_at_end``: at the end of training the
    Trainer deletes every checkpoint but the best one (here the first: the metric falls
    with each step). The private file of the deleted last checkpoint was left behind;
    now the private folder holds exactly the files of the checkpoints that remain."""
    out, private = tmp_path / "out", tmp_path / "private"
    trainer = None

    def metrics(_):  # one more step, a worse score: the first checkpoint is the best
        return {"order": -trainer.state.global_step}

    trainer = DPTrainer(
        model=_llama(classify=True),
        args=_args(out, max_steps=2, save_strategy="steps", save_steps=1,
                   eval_strategy="steps", eval_steps=1, save_total_limit=1,
                   load_best_model_at_end=True, metric_for_best_model="order",
                   greater_is_better=True, logging_steps=50),
        train_dataset=_TextSet(n=16, classify=True),
        eval_dataset=_TextSet(n=4, classify=True, seed=1), compute_metrics=metrics,
        privacy=PrivacyArguments(noise_multiplier=1.0, seed=0), private_state_dir=private)
    trainer.train()
    assert sorted(os.listdir(out)) == ["checkpoint-1"]
    assert sorted(os.listdir(private)) == [os.path.basename(_private_file(private,
                                                                          out / "checkpoint-1"))]


def test_a_renamed_checkpoint_finds_its_private_state_by_its_token(tmp_path):
    """``push_to_hub(hub_strategy="checkpoint")`` uploads the checkpoint as
    ``last-checkpoint``, and a user may copy ``checkpoint-2`` to ``best/``: the private
    file was looked up by the folder's name, so resuming the copy was refused. It is now
    found by the token the checkpoint carries; the copy resumes bit for bit, and a token
    no private file has is still refused."""
    out, private = tmp_path / "out", tmp_path / "private"
    args = _args(out, max_steps=3, save_strategy="steps", save_steps=2)
    pa = PrivacyArguments(noise_multiplier=1.0, seed=0)
    a = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(), privacy=pa,
                  private_state_dir=private)
    a.train()
    copy = str(tmp_path / "last-checkpoint")
    shutil.copytree(out / "checkpoint-2", copy)
    b = DPTrainer(model=_llama(seed=5), args=args, train_dataset=_TextSet(), privacy=pa,
                  private_state_dir=private)
    b.train(resume_from_checkpoint=copy)
    assert b.privacy_engine.accountant.steps == 3 and b.epsilon() == a.epsilon()
    for (name, u), v in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0, msg=name)

    state_file = os.path.join(copy, PRIVACY_STATE_NAME)
    state = torch.load(state_file, weights_only=False)
    state["private_state"]["token"] = "0" * 16  # a checkpoint no private file belongs to
    torch.save(state, state_file)
    c = DPTrainer(model=_llama(), args=args, train_dataset=_TextSet(), privacy=pa,
                  private_state_dir=private)
    with pytest.raises(ValueError, match="is not in private_state_dir"):
        c.train(resume_from_checkpoint=copy)
    state["private_state"]["token"] = "../" + os.path.basename(private)  # not a token
    torch.save(state, state_file)
    with pytest.raises(ValueError, match="not one DPTrainer writes"):
        c.train(resume_from_checkpoint=copy)
    assert c.state.global_step == 0 and c.privacy_engine is None
