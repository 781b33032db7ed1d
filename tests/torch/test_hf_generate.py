"""DPTrainer with ``Seq2SeqTrainingArguments(predict_with_generate=True)``: ``predict``
and ``evaluate`` return the ids ``model.generate`` produces, padded as transformers'
``Seq2SeqTrainer`` pads them (compared with that trainer on the same model), with the
loss evaluation reports without generation; generation records nothing in the engine,
takes no step and spends nothing, so a run evaluating with generation after every step
ends with the weights and epsilon of the same run without evaluation."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_zoo import build  # noqa: E402
from test_hf_seq2seq import B, _Pairs  # noqa: E402
from test_hf_trainer import _eps  # noqa: E402

from privlearn.errors import PrivacyLeakWarning  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402

N = 16


def _args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=B,
        max_steps=2,
        learning_rate=0.05,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        lr_scheduler_type="constant",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        per_device_eval_batch_size=5,
        predict_with_generate=True,
    )
    base.update(kw)
    return transformers.Seq2SeqTrainingArguments(**base)


def _trainer(model, args, data):
    return DPTrainer(
        model=model,
        args=args,
        train_dataset=data,
        privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0, seed=0),
    )


@pytest.mark.parametrize("name", ["bart", "t5_frozen_bias"])
def test_predictions_are_generated_ids_as_seq2seq_trainer_pads_them(name, tmp_path):
    model = build(name, torch.float32)
    train, held_out = _Pairs(0), _Pairs(1)
    tr = _trainer(model, _args(tmp_path, generation_max_length=9, generation_num_beams=2), train)
    tr.train()
    eps, steps = tr.epsilon(), tr.privacy_engine.accountant.steps
    out = tr.predict(held_out)
    ids = torch.as_tensor(out.predictions)
    assert ids.shape[0] == N and ids.shape[1] == model.generation_config.max_length
    model.eval()
    with torch.no_grad():
        ref = model.generate(
            input_ids=held_out.src, attention_mask=held_out.mask, max_length=9, num_beams=2
        )
    assert torch.equal(ids[:, : ref.shape[1]], ref)
    # the call's generate arguments win over the arguments'
    short = torch.as_tensor(tr.predict(held_out, max_length=4, num_beams=1).predictions)
    with torch.no_grad():
        ref4 = model.generate(
            input_ids=held_out.src, attention_mask=held_out.mask, max_length=4, num_beams=1
        )
    assert torch.equal(short[:, : ref4.shape[1]], ref4)
    assert (short[:, ref4.shape[1] :] == model.config.pad_token_id).all()
    # transformers' Seq2SeqTrainer on the same model: the same ids and padded labels
    peer = transformers.Seq2SeqTrainer(
        model=copy.deepcopy(model),
        args=_args(tmp_path / "peer", generation_max_length=9, generation_num_beams=2),
    )
    theirs = peer.predict(held_out)
    assert torch.equal(ids, torch.as_tensor(theirs.predictions))
    assert torch.equal(torch.as_tensor(out.label_ids), torch.as_tensor(theirs.label_ids))
    # the loss is the one reported without generation (the mean of per-example losses)
    tr.args.predict_with_generate = False
    plain = tr.predict(held_out)
    assert out.metrics["test_loss"] == pytest.approx(plain.metrics["test_loss"], rel=1e-6)
    tr.args.predict_with_generate = True
    with pytest.warns(PrivacyLeakWarning, match="shares examples"):
        tr.predict(train)
    assert tr.privacy_engine.accountant.steps == steps and tr.epsilon() == eps


def test_evaluating_with_generation_during_training_changes_nothing_of_the_run(tmp_path):
    runs, seen = [], []

    def metrics(p):  # (with compute_metrics the Trainer asks for predictions: generated)
        seen.append(p.predictions.shape)
        return {"generated": float((p.predictions != 1).sum(axis=1).mean())}

    for evaluating in (False, True):
        model = build("bart", torch.float32)
        extra = dict(eval_strategy="steps", eval_steps=1, logging_steps=1) if evaluating else {}
        tr = DPTrainer(
            model=model,
            args=_args(tmp_path / str(evaluating), max_steps=3, generation_max_length=5, **extra),
            train_dataset=_Pairs(0),
            eval_dataset=_Pairs(1),
            compute_metrics=metrics if evaluating else None,
            privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0, seed=0),
        )
        tr.train()
        assert tr.privacy_engine.accountant.steps == 3
        assert tr.epsilon() == pytest.approx(_eps(1.0, 3, q=B / N), rel=1e-6)
        runs.append((model, tr))
    evals = [h for h in runs[1][1].state.log_history if "eval_generated" in h]
    assert len(evals) == 3 and seen == [(N, 20)] * 3  # ids padded to max_length (20)
    after = runs[1][0].state_dict()
    for k, v in runs[0][0].state_dict().items():
        assert torch.equal(v, after[k]), k


def test_generation_config_of_the_arguments_replaces_the_models(tmp_path):
    model = build("bart", torch.float32)
    config = transformers.GenerationConfig(
        max_length=7, num_beams=1, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1
    )
    tr = _trainer(model, _args(tmp_path, generation_config=config), _Pairs(0))
    assert tr.model.generation_config.max_length == 7
    ids = torch.as_tensor(tr.predict(_Pairs(1)).predictions)
    model.eval()
    with torch.no_grad():
        ref = model.generate(input_ids=_Pairs(1).src, attention_mask=_Pairs(1).mask)
    assert ids.shape == (N, 7) and torch.equal(ids[:, : ref.shape[1]], ref)
