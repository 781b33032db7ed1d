"""The settings of a DP-SGD run are declared once, by DPConfig's fields: make_private's
keywords, the documented attributes and PrivacyArguments' privacy fields follow them."""

import copy
import dataclasses
import inspect
import re

import pytest

torch = pytest.importorskip("torch")

from privlearn.errors import (  # noqa: E402
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
)
from privlearn.torch import DPConfig, make_private  # noqa: E402
from privlearn.torch.config import Clipping, Noise, Reduction  # noqa: E402

_OWN = ["model", "optimizer", "data_loader", "config"]
_ENGINE = ["ledger", "process_group", "grad_scaler", "resume"]


def documented_attributes(cls) -> list[str]:
    """The names a NumPy docstring's Attributes section documents (``a, b : type`` lines,
    also when a list of names runs over several lines)."""
    doc = inspect.cleandoc(cls.__doc__)
    section = re.search(r"^Attributes\n-+\n(.*?)(?=^\w[^\n]*\n-+\n|\Z)", doc, re.S | re.M)
    names = []
    for line in section.group(1).splitlines():
        if line and not line.startswith(" "):  # a header line (descriptions are indented)
            names += [n.strip() for n in line.split(" : ")[0].split(",") if n.strip()]
    return names


def test_make_private_signature_is_dpconfig_fields():
    sig = inspect.signature(make_private)
    params = list(sig.parameters.values())
    settings = [f.name for f in dataclasses.fields(DPConfig)]
    assert [p.name for p in params] == _OWN + settings + _ENGINE
    by_name = sig.parameters
    for f in dataclasses.fields(DPConfig):
        p = by_name[f.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY
        assert p.default == f.default and type(p.default) is type(f.default), f.name
        assert p.annotation == f.type, f.name


def test_dpconfig_documents_every_field_once():
    names = documented_attributes(DPConfig)
    assert sorted(names) == sorted(DPConfig.names())
    assert len(names) == len(set(names))


def _training():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    return model, opt, torch.utils.data.DataLoader(data, batch_size=4)


def test_keywords_and_config_make_the_same_run():
    settings = dict(noise_multiplier=1.3, max_grad_norm=0.7, clipping="flat", seed=3)
    by_keywords = make_private(*_training(), **settings)
    by_config = make_private(*_training(), DPConfig(**settings))
    assert by_keywords.config == by_config.config == DPConfig(**settings)
    assert by_keywords.noise_multiplier == by_config.noise_multiplier == 1.3


def test_unknown_or_doubled_settings_are_refused_before_anything_is_built():
    model, opt, loader = _training()
    hooks_before = dict(model._forward_hooks)
    with pytest.raises(ParameterTypeError, match="max_grad_norm"):
        make_private(model, opt, loader, noise_multiplier=1.0, max_grad_nrom=1.0)
    with pytest.raises(ParameterValueError, match="either as one DPConfig or as keywords"):
        make_private(model, opt, loader, DPConfig(noise_multiplier=1.0), max_grad_norm=2.0)
    with pytest.raises(ParameterTypeError, match="DPConfig"):
        make_private(model, opt, loader, {"noise_multiplier": 1.0})
    assert dict(model._forward_hooks) == hooks_before
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("settings", [
    dict(target_epsilon=2.0, epochs=10, steps=5),
    dict(target_epsilon=2.0, epochs=1, steps=50),
    dict(noise_multiplier=1.0, epochs=2, steps=3),
])
def test_epochs_and_steps_together_are_refused(settings):
    """The planned length is epochs or steps: given both, the plan used to follow steps
    alone (``epochs=10, steps=5`` calibrated the noise for 5 steps and stopped the
    run at the target there), whatever the epochs said."""
    model, opt, loader = _training()
    with pytest.raises(ConfigurationError, match="one of epochs and steps"):
        make_private(model, opt, loader, **settings)
    with pytest.raises(ConfigurationError, match="one of epochs and steps"):
        DPConfig(**settings)
    assert not model._forward_hooks


@pytest.mark.parametrize("name, hint", [("prv", "'pld'"), ("gdp", "can understate"),
                                        ("renyi", "register_accountant")])
def test_unknown_accountant_is_refused_before_training(name, hint):
    # a name the registry does not know used to pass make_private and fail only at the
    # first epsilon() after the steps had run
    model, opt, loader = _training()
    with pytest.raises(ParameterValueError, match=hint) as err:
        make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                     accountant=name)
    assert repr(name) in str(err.value) and "'pld', 'rdp'" in str(err.value)
    assert dict(model._forward_hooks) == {}


def test_an_accountant_name_is_kept_as_the_registry_keys_it():
    """"PLD" and " rdp" name the registry's "pld" and "rdp" (get_accountant strips and
    lowercases): the run keeps that name, so a checkpoint of a run made with
    accountant="pld" loads into one made with "PLD" (it was refused as another
    accountant), and one made with "rdp" is still refused."""
    import copy

    from torch import nn

    def run(name):
        model, opt, loader = _training()
        return make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                            accountant=name, seed=0)

    assert DPConfig(noise_multiplier=1.0, accountant=" Rdp").accountant == "rdp"
    p = run("pld")
    x, y = next(iter(p.data_loader))
    p.optimizer.zero_grad()
    out = p.model(x)
    (nn.functional.cross_entropy(out, y) if len(y) else out.sum()).backward()
    p.optimizer.step()
    state = copy.deepcopy(p.state_dict())
    upper = run("PLD")
    assert upper.accountant.accountant == "pld"
    upper.load_state_dict(state)
    assert upper.epsilon(1e-5) == p.epsilon(1e-5) > 0
    with pytest.raises(ConfigurationError, match="accountant"):
        run("rdp").load_state_dict(state)


def test_accountant_that_cannot_describe_the_steps_is_refused_before_training():
    # "analytic" is exact for unsubsampled Gaussians only: refused when make_private
    # returns, not at the first epsilon() after the steps (with or without a plan)
    from privlearn.errors import UnsupportedMechanismError

    for plan in ({}, {"epochs": 1}):
        model, opt, loader = _training()
        with pytest.raises(UnsupportedMechanismError, match="accountant='pld'"):
            make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                         accountant="analytic", **plan)
        assert dict(model._forward_hooks) == {}


def test_opacus_settings_and_tuple_unpacking_say_what_to_use():
    with pytest.raises(ParameterTypeError, match="sampling='poisson'"):
        make_private(*_training(), noise_multiplier=1.0, max_grad_norm=1.0,
                     poisson_sampling=True)
    with pytest.raises(ParameterTypeError, match="engine picks"):
        make_private(*_training(), noise_multiplier=1.0, max_grad_norm=1.0,
                     grad_sample_mode="ghost")
    with pytest.raises(TypeError, match="p.model, p.optimizer, p.data_loader"):
        model, optimizer, loader = make_private(*_training(), noise_multiplier=1.0,
                                                max_grad_norm=1.0)


@pytest.mark.parametrize("name, enum", [("clipping", Clipping), ("loss_reduction", Reduction),
                                        ("user_reduction", Reduction), ("noise", Noise)])
def test_choices_are_string_enums(name, enum):
    extra = {"clipping": {}, "loss_reduction": {}, "user_reduction": {},
             "noise": {"sampling": "cyclic_poisson", "steps": 4}}[name]
    for member in enum:
        if name == "clipping" and member is Clipping.ADAPTIVE:
            kw = {"target_unclipped_quantile": 0.5}
        elif name == "clipping" and member is Clipping.PER_LAYER:
            kw = {"max_grad_norm": [1.0]}
        elif name == "noise" and member is Noise.DPSGD:
            kw = {}
        else:
            kw = dict(extra)
        from_string = DPConfig(noise_multiplier=1.0, **{name: member.value.upper()}, **kw)
        from_member = DPConfig(noise_multiplier=1.0, **{name: member}, **kw)
        value = getattr(from_string, name)
        assert value is member and getattr(from_member, name) is member
        assert value == member.value and f"{value}" == member.value
        assert repr(value) == repr(member.value)  # the config's repr reads as written
        assert {member.value: 1}[value] == 1
    with pytest.raises(ParameterValueError, match=", ".join(repr(m.value) for m in enum)):
        DPConfig(noise_multiplier=1.0, **{name: "nonesuch"})


def test_mechanism_is_plain_data():
    """A checkpoint's mechanism holds builtin values (loadable with weights_only=True)."""
    cfg = DPConfig(noise_multiplier=1.0, clipping=Clipping.PER_LAYER, max_grad_norm=[1.0],
                   loss_reduction="sum")
    for key, value in cfg.mechanism().items():
        assert value is None or type(value) in (str, int, float), key


def test_privacy_arguments_fields_are_dpconfig_fields():
    hf = pytest.importorskip("privlearn.torch.hf")
    ours = {f.name: f for f in dataclasses.fields(DPConfig)}
    from privlearn.torch._hf_args import _RENAMED

    theirs = dataclasses.fields(hf.PrivacyArguments)
    shared = [f for f in theirs if f.name not in hf._TRAINER_FIELDS]
    assert len(shared) >= 20 and set(hf._TRAINER_FIELDS) <= {f.name for f in theirs}
    # the two fields TrainingArguments also has are renamed (one parser holds both)
    assert _RENAMED == {"dp_max_grad_norm": "max_grad_norm", "dp_seed": "seed"}
    for f in shared:
        name = _RENAMED.get(f.name, f.name)
        assert name in ours, f"PrivacyArguments.{f.name} is not a DPConfig setting"
        if name == "max_grad_norm":  # also the text of a command line
            assert f.type.split(" | ") == ["float", "str", "list", "dict"]
            assert ours[name].type.split(" | ") == ["float", "list", "dict"]
        elif name == "batch_dims":  # also the text of a command line
            assert f.type.split(" | ") == ["dict", "str", "None"]
            assert ours[name].type.split(" | ") == ["dict", "None"]
        else:
            assert f.type == ours[name].type, f.name
        assert f.default == ours[name].default, f.name
        assert type(f.default) is type(ours[name].default), f.name
    assert sorted(documented_attributes(hf.PrivacyArguments)) == sorted(f.name for f in theirs)
    args = hf.PrivacyArguments(noise_multiplier=1.0, clipping="per_layer",
                               max_grad_norm=[1.0, 2.0])
    assert set(args.engine_settings()) == {_RENAMED.get(f.name, f.name) for f in shared}


def _opacus_keywords() -> list[str]:
    """The keyword names of Opacus's PrivacyEngine, make_private and
    make_private_with_epsilon (the peer, test-only)."""
    opacus = pytest.importorskip("opacus")
    names = []
    for fn in (opacus.PrivacyEngine.__init__, opacus.PrivacyEngine.make_private,
               opacus.PrivacyEngine.make_private_with_epsilon):
        names += [n for n, p in inspect.signature(fn).parameters.items()
                  if n != "self" and p.kind is not p.VAR_KEYWORD and n not in names]
    return names


def test_every_opacus_keyword_is_ours_or_named_with_what_to_use():
    """Each keyword of Opacus's make_private family either is a setting here or is
    refused with a typed error that names it and what to use instead; ``module=`` (where
    this library says ``model``) too, not Python's bare missing-argument TypeError."""
    ours = set(inspect.signature(make_private).parameters)
    foreign = [n for n in _opacus_keywords() if n not in ours]
    assert "module" in foreign and "poisson_sampling" in foreign
    for name in foreign:
        model, opt, loader = _training()
        args = dict(model=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                    max_grad_norm=1.0)
        if name == "module":
            args["module"] = args.pop("model")
        else:
            args[name] = None
        with pytest.raises(ParameterTypeError) as err:
            make_private(**args)
        assert f"{name}: " in str(err.value), (name, str(err.value))
        assert dict(model._forward_hooks) == {}
    with pytest.raises(ParameterTypeError, match="model="):
        make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0)


def test_opacus_methods_called_on_what_make_private_returns_say_what_to_use():
    """``p.get_epsilon(delta)``, ``p.accountant.get_epsilon(delta)``, ... (Opacus's
    PrivacyEngine and accountant methods): an AttributeError naming the counterpart; each
    name of the table is one of Opacus's (the peer, test-only); other missing attributes
    keep Python's wording, and hasattr is False for all."""
    opacus = pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    from privlearn.torch.accountant import OPACUS_METHODS

    for name in OPACUS_METHODS:  # history: set by the accountant's __init__
        assert hasattr(opacus.PrivacyEngine, name) or hasattr(RDPAccountant(), name), name
    model, opt, loader = _training()
    p = make_private(model, opt, loader, noise_multiplier=1.0)
    for obj, owner in ((p, "PrivateTraining"), (p.accountant, "PrivacyAccountant")):
        for name, use in OPACUS_METHODS.items():
            assert not hasattr(obj, name)
            with pytest.raises(AttributeError) as err:
                getattr(obj, name)
            assert str(err.value) == (f"{owner} has no {name} (a name of Opacus's "
                                      f"PrivacyEngine or accountants): use {use}")
        with pytest.raises(AttributeError, match=f"^'{owner}' object has no attribute 'nope'$"):
            _ = obj.nope
    assert "p.epsilon(delta)" in OPACUS_METHODS["get_epsilon"]


def test_opacus_optimizer_methods_on_p_optimizer_say_what_to_use():
    """``p.optimizer.signal_skip_step``, ``attach_step_hook``, ``grad_samples``, ... (Opacus's
    DPOptimizer; ``virtual_step``, Opacus 0.x's): an AttributeError naming the counterpart;
    other missing attributes keep Python's wording, also on an object ``__new__`` made
    (as copy and pickle make it), where ``__getattr__`` must not recurse."""
    opacus = pytest.importorskip("opacus")
    from privlearn.torch._optimizer_api import OPACUS_OPTIMIZER_METHODS

    for name in OPACUS_OPTIMIZER_METHODS:
        assert hasattr(opacus.optimizers.DPOptimizer, name) or name == "virtual_step", name
    model, opt, loader = _training()
    p = make_private(model, opt, loader, noise_multiplier=1.0)
    for name, use in OPACUS_OPTIMIZER_METHODS.items():
        assert not hasattr(p.optimizer, name)
        with pytest.raises(AttributeError) as err:
            getattr(p.optimizer, name)
        assert str(err.value) == (f"DPOptimizer has no {name} (of Opacus's DPOptimizer): "
                                  f"use {use}")
    with pytest.raises(AttributeError, match="^'DPOptimizer' object has no attribute 'nope'$"):
        _ = p.optimizer.nope
    bare = type(p.optimizer).__new__(type(p.optimizer))
    assert not hasattr(bare, "signal_skip_step") and not hasattr(bare, "param_groups")
    assert "max_physical_batch_size" in OPACUS_OPTIMIZER_METHODS["signal_skip_step"]


def test_a_dp_optimizer_built_by_hand_says_make_private_builds_it():
    """Opacus's tutorials build ``DPOptimizer(optimizer, noise_multiplier=...,
    max_grad_norm=..., expected_batch_size=...)`` by hand; here that raised Python's
    "missing 1 required positional argument: 'tracker'". It says what builds it; the
    optimizer make_private builds still deep-copies."""
    from privlearn.torch import DPOptimizer

    model, opt, loader = _training()
    for args, kwargs in (((opt,), dict(noise_multiplier=1.0, max_grad_norm=1.0,
                                       expected_batch_size=10)),
                         ((), dict(optimizer=opt, noise_multiplier=1.0, max_grad_norm=1.0)),
                         ((opt, object()), {})):
        with pytest.raises(TypeError, match=r"^DPOptimizer is built by privlearn\.torch\."
                                            r"make_private, not by hand") as err:
            DPOptimizer(*args, **kwargs)
        assert "p = make_private(model, optimizer, data_loader" in str(err.value)
    p = make_private(model, opt, loader, noise_multiplier=1.0)
    assert copy.deepcopy(p.optimizer).noise_multiplier == 1.0


def test_missing_or_misspelt_arguments_are_typed_errors_naming_them():
    model, opt, loader = _training()
    with pytest.raises(ParameterTypeError, match="data_loader") as err:
        make_private(model, opt, noise_multiplier=1.0, max_grad_norm=1.0)
    assert "missing" in str(err.value)
    with pytest.raises(ParameterTypeError, match="'data_loader' for 'dataloader'"):
        make_private(model=model, optimizer=opt, dataloader=loader, noise_multiplier=1.0)
    assert dict(model._forward_hooks) == {}


def test_dpconfig_names_unknown_settings_as_make_private_does():
    """``DPConfig(...)`` refuses an unknown setting with the same typed error and hints as
    make_private's keywords (Opacus's names included), not Python's bare TypeError; it
    still copies, replaces and pickles."""
    import pickle

    with pytest.raises(ParameterTypeError, match="poisson_sampling: Poisson sampling"):
        DPConfig(noise_multiplier=1.0, poisson_sampling=False)
    with pytest.raises(ParameterTypeError, match="'max_grad_norm' for 'max_grad_nrom'"):
        DPConfig(max_grad_nrom=1.0)
    cfg = DPConfig(noise_multiplier=1.0, seed=3)
    assert dataclasses.replace(cfg, seed=4).seed == 4
    assert pickle.loads(pickle.dumps(cfg)) == cfg


#: The privacy arguments of dp-transformers (``dp_transformers.PrivacyArguments``) and of
#: private-transformers (``PrivacyEngine``), as their documentation lists them.
_DP_TRANSFORMERS = ("per_sample_max_grad_norm", "noise_multiplier", "target_epsilon",
                    "target_delta", "disable_dp")
_PRIVATE_TRANSFORMERS = ("batch_size", "sample_size", "epochs", "max_grad_norm",
                         "noise_multiplier", "target_epsilon", "target_delta", "alphas",
                         "record_snr", "named_params", "numerical_stability_constant",
                         "clipping_mode", "accounting_mode", "eps_error", "skip_checks")


def test_privacy_arguments_name_other_libraries_settings_as_make_private_does():
    """``PrivacyArguments(...)`` refuses a name of Opacus, dp-transformers or
    private-transformers (or a DPConfig setting the Trainer plans itself) with the typed
    error of make_private and DPConfig, saying what to use, not a bare TypeError."""
    hf = pytest.importorskip("privlearn.torch.hf")
    from privlearn.torch.config import _OTHER_SETTINGS

    ours = {f.name for f in dataclasses.fields(hf.PrivacyArguments)} | {"max_grad_norm", "seed"}
    foreign = sorted((set(_DP_TRANSFORMERS) | set(_PRIVATE_TRANSFORMERS)
                      | set(_opacus_keywords()) | set(DPConfig.names())) - ours)
    assert {"per_sample_max_grad_norm", "disable_dp", "poisson_sampling", "epochs"} <= set(
        foreign)
    for name in foreign:
        with pytest.raises(ParameterTypeError) as err:
            hf.PrivacyArguments(noise_multiplier=1.0, **{name: None})
        said = str(err.value)
        assert f"unknown settings [{name!r}]" in said and "fields of PrivacyArguments" in said
        # what to use: the table's line, or the closest field
        assert f"{name}: " in said or f"for {name!r}?" in said, (name, said)
    with pytest.raises(ParameterTypeError, match="use max_grad_norm"):
        hf.PrivacyArguments(target_epsilon=3.0, per_sample_max_grad_norm=1.0)
    with pytest.raises(ParameterTypeError, match="num_train_epochs"):
        hf.PrivacyArguments(target_epsilon=3.0, epochs=3)
    with pytest.raises(ParameterTypeError, match="'max_grad_norm' for 'max_grad_nrom'"):
        hf.PrivacyArguments(noise_multiplier=1.0, max_grad_nrom=1.0)
    # one table: every name it holds that is not a DPConfig setting is refused there too
    for name in sorted(set(_OTHER_SETTINGS) - set(DPConfig.names())):
        with pytest.raises(ParameterTypeError, match=re.escape(_OTHER_SETTINGS[name])):
            DPConfig(noise_multiplier=1.0, **{name: None})
    # the names the libraries share with this one mean the same and are accepted
    shared = dict(noise_multiplier=1.0, target_delta=1e-6, max_grad_norm=0.5)
    args = hf.PrivacyArguments(**shared)
    assert {k: getattr(args, k) for k in shared} == shared
    import pickle

    assert dataclasses.replace(args, noise_multiplier=2.0).noise_multiplier == 2.0
    assert pickle.loads(pickle.dumps(args)) == args
