"""PrivacyArguments (privlearn.torch._hf_args) parsed as Hugging Face scripts parse their
arguments: ``HfArgumentParser((TrainingArguments, PrivacyArguments))``, from a command
line and from a dict (a JSON or YAML file), into a DPTrainer that trains with what was
parsed."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import FeatureModel, FeatureSet  # noqa: E402

from privlearn.errors import ParameterTypeError, ParameterValueError  # noqa: E402
from privlearn.torch.config import Clipping, Noise  # noqa: E402
from privlearn.torch.hf import DPTrainer, PrivacyArguments  # noqa: E402


@pytest.fixture
def parser():
    """An HfArgumentParser of both dataclasses; the parser rewrites the ``type`` of the
    dataclasses' fields (transformers' own behaviour), which is undone afterwards so that
    other tests see the classes as declared."""
    classes = (transformers.TrainingArguments, PrivacyArguments)
    saved = [(f, f.type) for c in classes for f in dataclasses.fields(c)]
    yield transformers.HfArgumentParser(classes)
    for f, t in saved:
        f.type = t


def test_training_and_privacy_arguments_parse_from_one_command_line(parser):
    training, privacy = parser.parse_args_into_dataclasses([
        "--output_dir", "out", "--max_grad_norm", "7", "--seed", "5",
        "--target_epsilon", "3", "--target_delta", "1e-6", "--dp_max_grad_norm", "0.5",
        "--dp_seed", "11", "--clipping", "adaptive", "--target_unclipped_quantile", "0.5",
        "--secure_mode", "false", "--no_check_batch_independence", "--noise", "dpsgd",
        "--user_reduction", "sum", "--max_epsilon", "4"])
    assert isinstance(privacy, PrivacyArguments)
    # each parser's clipping bound and seed are its own
    assert (training.max_grad_norm, training.seed) == (7.0, 5)
    assert (privacy.dp_max_grad_norm, privacy.dp_seed) == (0.5, 11)
    assert (privacy.max_grad_norm, privacy.seed) == (0.5, 11)  # make_private's names
    assert privacy.target_epsilon == 3.0 and privacy.target_delta == 1e-6
    assert privacy.max_epsilon == 4.0 and privacy.target_unclipped_quantile == 0.5
    assert privacy.clipping == Clipping.ADAPTIVE and privacy.noise == Noise.DPSGD
    assert privacy.user_reduction == "sum"
    assert privacy.check_batch_independence is False and privacy.secure_mode is False
    settings = privacy.engine_settings()
    assert settings["max_grad_norm"] == 0.5 and settings["seed"] == 11
    assert "dp_max_grad_norm" not in settings and "dp_seed" not in settings


def test_defaults_parse_to_the_defaults_of_the_dataclass(parser):
    _, privacy = parser.parse_args_into_dataclasses(["--output_dir", "out",
                                                     "--noise_multiplier", "1.0"])
    assert privacy == PrivacyArguments(noise_multiplier=1.0)


def test_help_lists_the_privacy_flags(parser, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args_into_dataclasses(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--dp_max_grad_norm", "--dp_seed", "--target_epsilon", "--noise_multiplier",
                 "--max_grad_norm", "--seed"):
        assert flag in out
    # the privacy settings in a section of their own, each with its help
    assert "DP-SGD settings (privlearn PrivacyArguments):" in out
    assert all(f.metadata.get("help") for f in dataclasses.fields(PrivacyArguments))
    assert "Per-example clipping bound" in out


_ADAPTIVE = ["--clipping", "adaptive", "--target_unclipped_quantile", "0.5"]
#: Each field from a command line: (its flags, and the settings they mean in Python).
_FROM_COMMAND_LINE = {
    "noise_multiplier": (["--noise_multiplier", "1.5"], {"noise_multiplier": 1.5}),
    "target_epsilon": (["--target_epsilon", "3"], {"target_epsilon": 3.0}),
    "target_delta": (["--target_delta", "1e-6"], {"target_delta": 1e-6}),
    "dp_max_grad_norm": (["--dp_max_grad_norm", "0.5"], {"max_grad_norm": 0.5}),
    "max_epsilon": (["--max_epsilon", "4"], {"max_epsilon": 4.0}),
    "sampling": (["--sampling", "fixed"], {"sampling": "fixed"}),
    "accountant": (["--accountant", "rdp"], {"accountant": "rdp"}),
    "secure_mode": (["--secure_mode", "true"], {"secure_mode": True}),
    "dp_seed": (["--dp_seed", "3"], {"seed": 3}),
    "clipping": (_ADAPTIVE, {"clipping": "adaptive", "target_unclipped_quantile": 0.5}),
    "target_unclipped_quantile": (
        ["--clipping", "adaptive", "--target_unclipped_quantile", "0.6"],
        {"clipping": "adaptive", "target_unclipped_quantile": 0.6}),
    "clipbound_learning_rate": (
        [*_ADAPTIVE, "--clipbound_learning_rate", "0.1"],
        {"clipping": "adaptive", "target_unclipped_quantile": 0.5,
         "clipbound_learning_rate": 0.1}),
    "unclipped_num_std": (
        [*_ADAPTIVE, "--unclipped_num_std", "5"],
        {"clipping": "adaptive", "target_unclipped_quantile": 0.5, "unclipped_num_std": 5.0}),
    "batch_dims": (["--batch_dims", '{"encoder.lstm": 1, "head": 0}'],
                   {"batch_dims": {"encoder.lstm": 1, "head": 0}}),
    "check_batch_independence": (["--check_batch_independence", "false"],
                                 {"check_batch_independence": False}),
    "noise": (["--noise", "blt", "--sampling", "balls_in_bins"],
              {"noise": "blt", "sampling": "balls_in_bins"}),
    "bands": (["--noise", "banded", "--bands", "4", "--sampling", "cyclic_poisson"],
              {"noise": "banded", "bands": 4, "sampling": "cyclic_poisson"}),
    "buffers": (["--noise", "blt", "--buffers", "2", "--sampling", "balls_in_bins"],
                {"noise": "blt", "buffers": 2, "sampling": "balls_in_bins"}),
    "cycle_length": (["--sampling", "cyclic_poisson", "--cycle_length", "4"],
                     {"sampling": "cyclic_poisson", "cycle_length": 4}),
    "user_column": (["--user_column", "user"], {"user_column": "user"}),
    "max_examples_per_user": (["--user_column", "user", "--max_examples_per_user", "2"],
                              {"user_column": "user", "max_examples_per_user": 2}),
    "user_reduction": (["--user_reduction", "sum"], {"user_reduction": "sum"}),
    "task": (["--task", "causal_lm"], {"task": "causal_lm"}),
    "log_training_loss": (["--log_training_loss", "true"], {"log_training_loss": True}),
    "agreement_timeout": (["--agreement_timeout", "42.5"], {"agreement_timeout": 42.5}),
}


def test_the_command_line_table_covers_every_field():
    assert set(_FROM_COMMAND_LINE) == {f.name for f in dataclasses.fields(PrivacyArguments)}


@pytest.mark.parametrize("name", sorted(_FROM_COMMAND_LINE))
def test_every_field_parses_from_a_command_line(parser, name):
    """Each setting given on a command line is the setting given in Python."""
    flags, settings = _FROM_COMMAND_LINE[name]
    base = {} if name == "target_epsilon" else {"noise_multiplier": 1.0}
    argv = ["--output_dir", "out", *(f for k, v in base.items() if k not in settings
                                      for f in (f"--{k}", str(v))), *flags]
    _, privacy = parser.parse_args_into_dataclasses(argv)
    assert privacy == PrivacyArguments(**{**base, **settings})


def test_batch_dims_text_that_is_not_a_json_object_is_refused(parser):
    for text in ("lstm=1", "[1]", "{'lstm': 1}"):
        with pytest.raises(ParameterValueError, match=r"batch_dims must be a JSON object.*"
                                                      r"--batch_dims '\{\"encoder.lstm\": 1\}'"):
            parser.parse_args_into_dataclasses(["--output_dir", "out", "--noise_multiplier",
                                                "1", "--batch_dims", text])


def test_a_bad_value_is_refused_with_the_setting_named(parser):
    with pytest.raises(ParameterValueError, match="target_delta"):
        parser.parse_args_into_dataclasses(["--output_dir", "out", "--noise_multiplier",
                                            "1.0", "--target_delta", "2"])


def test_virtual_batches_are_pointed_at_gradient_accumulation():
    """max_physical_batch_size is not a PrivacyArguments setting: a DPTrainer's physical
    chunk is per_device_train_batch_size and its logical batch that times
    gradient_accumulation_steps, which the refusal names."""
    with pytest.raises(ParameterTypeError, match=r"max_physical_batch_size: .*physical chunks "
                       r"of per_device_train_batch_size.*gradient_accumulation_steps=") as e:
        PrivacyArguments(noise_multiplier=1.0, max_physical_batch_size=4)
    assert "must be 1" not in str(e.value)


def test_per_layer_bounds_from_a_dict_or_from_text(parser):
    _, privacy = parser.parse_dict({"output_dir": "out", "noise_multiplier": 1.0,
                                    "clipping": "per_layer", "dp_max_grad_norm": [1.0, 2.0]})
    assert privacy.dp_max_grad_norm == [1.0, 2.0]
    assert PrivacyArguments(noise_multiplier=1.0, dp_max_grad_norm="0.25").max_grad_norm == 0.25
    as_text = PrivacyArguments(noise_multiplier=1.0, clipping="per_layer",
                               dp_max_grad_norm='{"0.weight": 1.0, "0.bias": 0.5}')
    assert as_text.dp_max_grad_norm == {"0.weight": 1.0, "0.bias": 0.5}
    with pytest.raises(ParameterValueError, match="dp_max_grad_norm.*'one'"):
        PrivacyArguments(noise_multiplier=1.0, dp_max_grad_norm="one")
    with pytest.raises(ParameterValueError, match="max_grad_norm"):
        PrivacyArguments(noise_multiplier=1.0, dp_max_grad_norm="-1")


def test_make_private_names_are_the_same_settings():
    a = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5, seed=3)
    assert a == PrivacyArguments(noise_multiplier=1.0, dp_max_grad_norm=0.5, dp_seed=3)
    assert dataclasses.replace(a, dp_seed=4).seed == 4
    # dataclasses.replace under make_private's names (every field and the change)
    b = dataclasses.replace(a, seed=5, max_grad_norm=[1.0], clipping="per_layer")
    assert (b.dp_seed, b.dp_max_grad_norm, b.clipping) == (5, [1.0], "per_layer")
    with pytest.raises(ParameterTypeError, match="both max_grad_norm= and dp_max_grad_norm="):
        PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5, dp_max_grad_norm=0.5)
    with pytest.raises(ParameterTypeError, match="both seed= and dp_seed="):
        PrivacyArguments(noise_multiplier=1.0, seed=1, dp_seed=1)


def test_a_pickle_of_the_former_field_names_loads():
    """Pickles of PrivacyArguments written when the fields were named max_grad_norm and
    seed load into the renamed fields."""
    import pickle

    a = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5, seed=3)
    assert pickle.loads(pickle.dumps(a)) == a
    renamed = {"dp_max_grad_norm": "max_grad_norm", "dp_seed": "seed"}
    old = {renamed.get(k, k): v for k, v in vars(a).items()}  # the state as then pickled
    assert "max_grad_norm" in old and "dp_max_grad_norm" not in old
    b = PrivacyArguments.__new__(PrivacyArguments)
    b.__setstate__(old)
    assert b == a and (b.max_grad_norm, b.seed) == (0.5, 3)


def test_a_parsed_command_line_trains_with_the_parsed_bound_and_seed(parser, tmp_path):
    argv = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "8",
            "--max_steps", "2", "--report_to", "none", "--use_cpu", "--save_strategy", "no",
            "--noise_multiplier", "1.3", "--dp_max_grad_norm", "0.25", "--dp_seed", "7",
            "--disable_tqdm", "true"]
    updates = []
    for _ in range(2):
        training, privacy = parser.parse_args_into_dataclasses(argv)
        torch.manual_seed(0)
        model = FeatureModel()
        before = model.fc.weight.detach().clone()
        trainer = DPTrainer(model=model, args=training, train_dataset=FeatureSet(), privacy=privacy)
        trainer.train()
        p = trainer.privacy_engine
        assert p.max_grad_norm == 0.25 and p.noise_multiplier == 1.3
        assert p.accountant.steps == 2
        updates.append(model.fc.weight.detach() - before)
    assert torch.equal(updates[0], updates[1])  # dp_seed seeds the sampler and the noise
    assert updates[0].abs().sum() > 0


def test_an_unused_trainer_clipping_bound_is_said(tmp_path):
    args = transformers.TrainingArguments(str(tmp_path), max_grad_norm=0.1, report_to=[],
                                          use_cpu=True, save_strategy="no")
    with pytest.warns(UserWarning, match=r"max_grad_norm=0\.1 .*not used by DPTrainer"
                                         r".*dp_max_grad_norm=1\.0"):
        DPTrainer(model=FeatureModel(), args=args, train_dataset=FeatureSet(),
                  privacy=PrivacyArguments(noise_multiplier=1.0))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for given in (1.0, 0.0):  # the Trainer's default, or none
            a = transformers.TrainingArguments(str(tmp_path), max_grad_norm=given,
                                               report_to=[], use_cpu=True,
                                               save_strategy="no")
            DPTrainer(model=FeatureModel(), args=a, train_dataset=FeatureSet(),
                      privacy=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=0.5))


def test_a_trainer_clipping_bound_set_after_the_trainer_was_built_is_said(tmp_path):
    """TrainingArguments.max_grad_norm set on the trainer's arguments after it was built
    (a hyperparameter_search trial's search space, a script) was silently replaced by 0
    when training started; it is said, as at construction, and still not used."""
    args = transformers.TrainingArguments(str(tmp_path), max_steps=1, report_to=[],
                                          use_cpu=True, save_strategy="no",
                                          per_device_train_batch_size=8)
    tr = DPTrainer(model=FeatureModel(), args=args, train_dataset=FeatureSet(),
                   privacy=PrivacyArguments(noise_multiplier=1.0, seed=0))
    tr.args.max_grad_norm = 0.3
    with pytest.warns(UserWarning, match=r"max_grad_norm=0\.3 .*not used by DPTrainer"):
        tr.train()
    assert tr.args.max_grad_norm == 0 and tr.privacy_engine.max_grad_norm == 1.0


@pytest.mark.parametrize("setting, error, match", [
    ({"per_device_train_batch_size": 9}, "ConfigurationError",
     r"per_device_train_batch_size=9 .*global batch of 9.*8 examples.*at most 8"),
    ({"per_device_train_batch_size": 0}, "ParameterValueError",
     r"per_device_train_batch_size must be an integer >= 1, got 0"),
    ({"max_steps": -1, "num_train_epochs": 0}, "ParameterValueError",
     r"num_train_epochs must be in \(0, inf\).*got 0"),
])
def test_batch_and_length_are_refused_in_the_trainers_terms(tmp_path, setting, error, match):
    """A batch larger than the training set, an empty batch, or no planned length with
    target_epsilon were refused in make_private's or DataLoader's words (the "batch size"
    and "epochs" a DPTrainer user never set; DataLoader's plain ValueError): now named as
    TrainingArguments names them, with the valid range, before anything runs."""
    from privlearn import errors

    setting = dict(setting)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[],
                                          save_strategy="no",
                                          max_steps=setting.pop("max_steps", 2), **setting)
    data = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([1, 2, 3])}] * 8
    tr = DPTrainer(model=model, args=args, train_dataset=data,
                   privacy=PrivacyArguments(target_epsilon=3.0))
    with pytest.raises(getattr(errors, error), match=match):
        tr.train()
    assert tr.privacy_engine is None and tr.state.global_step == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "soon"])
def test_a_bad_agreement_timeout_is_refused_as_make_private_refuses_it(bad):
    """PrivacyArguments(agreement_timeout=...) is make_private's setting: validated by the
    same rule, with the same typed error naming it, its range and the value given."""
    from privlearn.torch import DPConfig

    kind = ParameterTypeError if isinstance(bad, str) else ParameterValueError
    with pytest.raises(kind) as theirs:
        PrivacyArguments(noise_multiplier=1.0, agreement_timeout=bad)
    with pytest.raises(kind) as ours:
        DPConfig(noise_multiplier=1.0, agreement_timeout=bad)
    assert str(theirs.value) == str(ours.value)
    said = str(theirs.value)
    assert "agreement_timeout" in said and repr(bad) in said and "e.g. 300" in said
    if kind is ParameterValueError:
        assert "(0, inf)" in said


def test_a_dptrainer_hands_its_agreement_timeout_to_make_private(tmp_path):
    args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True,
                                          save_strategy="no", max_steps=1,
                                          per_device_train_batch_size=4)
    for given, expected in ((None, 300.0), (12.5, 12.5)):
        extra = {} if given is None else {"agreement_timeout": given}
        trainer = DPTrainer(model=FeatureModel(), args=args, train_dataset=FeatureSet(),
                            privacy=PrivacyArguments(noise_multiplier=1.0, **extra))
        trainer.get_train_dataloader()
        assert trainer.privacy_engine.config.agreement_timeout == expected


def test_a_resumed_run_may_wait_another_time_for_its_processes():
    """How long the processes wait for each other changes neither the mechanism nor its
    accounting: not recorded in a checkpoint, so a resumption (or a checkpoint written
    before the setting existed) may give another."""
    from privlearn.torch._hf_resume import check_resumed_settings, recorded_settings

    saved = recorded_settings(PrivacyArguments(noise_multiplier=1.0))
    assert "agreement_timeout" not in saved
    check_resumed_settings("checkpoint-2", saved,
                           PrivacyArguments(noise_multiplier=1.0, agreement_timeout=900.0))
