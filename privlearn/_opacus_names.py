"""Names an Opacus user imports that privlearn does not have, and what to use instead.

``from privlearn.torch import PrivacyEngine`` (an Opacus script's first line, edited)
would otherwise fail with Python's bare "cannot import name". The ``__getattr__`` of
:mod:`privlearn.torch` and :mod:`privlearn.accounting` call :func:`missing_name`, which
says what privlearn uses instead. Only names that privlearn has under no name of its own
are listed; a concept privlearn has under the same name (``DPOptimizer``) is exported
as it is.

No torch import here: :mod:`privlearn.accounting` uses it too.
"""

from __future__ import annotations

import dis
import types

__all__ = ["OPACUS_NAMES", "missing_name"]

_GUIDE = ("the guide 'coming from Opacus' of privlearn's documentation, which maps each "
          "Opacus call to privlearn's")
_MAKE_PRIVATE = ("p = privlearn.torch.make_private(model, optimizer, data_loader, "
                 "noise_multiplier=..., max_grad_norm=...)")
_ACCOUNTANT = ("privlearn.torch.PrivacyAccountant(accountant='rdp' or 'pld'), fed by "
               ".record_step(noise_multiplier=..., sampling_rate=..., max_grad_norm=...), "
               "read by .epsilon(delta); or, torch-free, privlearn.accounting: "
               "compose(subsample(Gaussian(noise_multiplier=s), rate=q), steps=T)"
               ".epsilon(delta, accountant='rdp')")
_NO_WRAPPER = ("no wrapper: make_private hooks your model in place (p.model is your "
               "model, p.detach() removes the hooks) and picks each layer's per-example "
               "gradient method itself")
_PICKED = ("p.optimizer, the optimizer make_private returns: one class for every clipping "
           "(clipping='flat', 'per_layer' or 'adaptive'), every per-example gradient "
           "method and distributed training (a model wrapped in DistributedDataParallel)")
_SCHEDULE = ("set p.optimizer.{0} between steps (e.g. p.optimizer.{1} once per epoch): "
             "the next steps use it and the accountant records each step with the value "
             "it used")
_LAYERS = ("PyTorch's own {} as it is: make_private computes its per-example gradient "
           "norms itself (Opacus's layers also work)")

#: Opacus's name -> what privlearn uses instead (the end of the error's message).
OPACUS_NAMES: dict[str, str] = {
    "PrivacyEngine": (
        f"{_MAKE_PRIVATE} does what PrivacyEngine().make_private(...) does (or with "
        "target_epsilon=..., target_delta=..., epochs=..., what make_private_with_epsilon "
        "does) and returns one PrivateTraining p: p.model, p.optimizer, p.data_loader, "
        "p.epsilon(delta), p.accountant"),
    "GradSampleModule": (
        "no wrapper: make_private hooks your model in place (p.model is your model, "
        "p.detach() removes the hooks); per-example gradients are not materialised "
        "(p.optimizer.last_grad_norms holds their norms)"),
    "GradSampleModuleFastGradientClipping": (
        "no wrapper: make_private hooks your model in place and picks each layer's "
        "per-example norm method itself (ghost norms where they are cheaper)"),
    "BatchMemoryManager": (
        "make_private(..., max_physical_batch_size=k): p.data_loader then yields chunks "
        "of at most k examples, and the loop stays the same (p.optimizer.step() after "
        "every chunk; noise and the update once per logical batch)"),
    "DPDataLoader": (
        "p.data_loader: make_private replaces your DataLoader's batching by Poisson "
        "sampling (sampling='poisson', the default; pass a DataLoader without "
        "shuffle=True or a sampler)"),
    "UniformWithReplacementSampler": (
        "privlearn.torch.PoissonBatchSampler(num_samples, sampling_rate, seed=...) for a "
        "sampler of your own; make_private builds it for you"),
    "get_noise_multiplier": (
        "privlearn.accounting.calibrate(lambda s: compose(subsample(Gaussian("
        "noise_multiplier=s), rate=q), steps=T), epsilon=..., delta=...), or "
        "make_private(..., target_epsilon=..., target_delta=..., epochs=...), which "
        "calibrates for you"),
    "ModuleValidator": (
        "privlearn.torch.validate(model) (the list of problems; [] when the model is "
        "fine), privlearn.torch.fix(model), or make_private(..., fix_model=True)"),
    "RDPAccountant": _ACCOUNTANT,
    "PRVAccountant": _ACCOUNTANT + " (accountant='pld' in place of Opacus's 'prv')",
    "GaussianAccountant": _ACCOUNTANT + " (there is no 'gdp' accountant)",
    "AdaClipDPOptimizer": (
        "make_private(..., clipping='adaptive', target_unclipped_quantile=..., "
        "clipbound_learning_rate=..., unclipped_num_std=...)"),
    "DPPerLayerOptimizer": "make_private(..., clipping='per_layer', max_grad_norm=[...])",
    "DPLSTM": _LAYERS.format("torch.nn.LSTM"),
    "DPGRU": _LAYERS.format("torch.nn.GRU"),
    "DPRNN": _LAYERS.format("torch.nn.RNN"),
    "DPMultiheadAttention": _LAYERS.format("torch.nn.MultiheadAttention"),
    "register_grad_sampler": (
        "privlearn.torch.register_rule(YourModule), on a function (module, record, params) "
        "-> Materialized(params, per-example gradients): Opacus's activations are "
        "record.args[0], its backprops record.grad(0) (the guide 'extending privlearn'); "
        "a module with no rule needs none (a torch.func fallback computes its per-example "
        "gradients)"),
    "register_norm_sampler": (
        "privlearn.torch.register_rule(YourModule), on a function returning a factored "
        "contribution whose norms are computed without materialising the per-example "
        "gradients (privlearn.torch.grad_sample.OuterProduct, as the rule of nn.Linear)"),
    "check_per_sample_gradients_are_correct": (
        "the check of the guide 'extending privlearn' (a new layer rule): one "
        "make_private step with noise_multiplier=0 against a loop of batch-of-one "
        "backward passes; make_private itself checks before the first step that each "
        "example's outputs depend on that example alone"),
    "GradSampleModuleExpandedWeights": _NO_WRAPPER,
    "GradSampleModuleNoOp": _NO_WRAPPER,
    "DifferentiallyPrivateDistributedDataParallel": (
        "PyTorch's torch.nn.parallel.DistributedDataParallel as it is: make_private(DDP("
        "model), optimizer, data_loader, ...) on every rank, after "
        "torch.distributed.init_process_group"),
    "DistributedDPOptimizer": _PICKED,
    "SimpleDistributedPerLayerOptimizer": _PICKED,
    "DPOptimizerFastGradientClipping": _PICKED,
    "DistributedDPOptimizerFastGradientClipping": _PICKED,
    "FSDPOptimizerFastGradientClipping": _PICKED,
    "DPLossFastGradientClipping": (
        "no loss wrapper: compute the loss as usual and call loss.backward() once; the "
        "engine uses ghost norms where they are cheaper, with no second backward pass"),
    "wrap_data_loader": (
        "make_private(..., max_physical_batch_size=k): p.data_loader then yields chunks "
        "of at most k examples (p.optimizer.step() after every chunk)"),
    "ExponentialNoise": _SCHEDULE.format("noise_multiplier", "noise_multiplier *= gamma"),
    "StepNoise": _SCHEDULE.format("noise_multiplier", "noise_multiplier *= gamma"),
    "LambdaNoise": _SCHEDULE.format("noise_multiplier", "noise_multiplier = f(epoch)"),
    "ExponentialGradClip": _SCHEDULE.format("max_grad_norm", "max_grad_norm *= gamma"),
    "StepGradClip": _SCHEDULE.format("max_grad_norm", "max_grad_norm *= gamma"),
    "LambdaGradClip": _SCHEDULE.format("max_grad_norm", "max_grad_norm = f(epoch)"),
    "IAccountant": (
        "privlearn.accounting.register_accountant(accountant) for an accountant of your "
        "own (an object with a name, epsilon(mechanism, delta) and delta(mechanism, "
        "epsilon); the guide 'extending privlearn')"),
}

_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _importing_from(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` is executing ``from module import name``: Python then reports
    an AttributeError as its own "cannot import name", without the message."""
    if frame is None:
        return False
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _IMPORT_FROM


def missing_name(module: str, name: str, caller: types.FrameType | None) -> Exception:
    """The error for ``module.name`` missing, for a module's ``__getattr__`` to raise.

    For a name of :data:`OPACUS_NAMES`, the message says what to use instead; it is an
    ImportError when ``caller`` (the frame that looked the name up) runs ``from module
    import name`` (Python would replace an AttributeError's message by its own), else an
    AttributeError (so that ``hasattr`` and ``getattr(module, name, default)`` work).
    Any other name gets Python's own AttributeError.
    """
    use = OPACUS_NAMES.get(name)
    if use is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    msg = f"{module} has no {name} (a name of Opacus's). Instead: {use}. See {_GUIDE}"
    if _importing_from(caller):
        return ImportError(msg, name=module)
    return AttributeError(msg)


def missing_method(owner: str, name: str, methods: dict[str, str], whose: str
                   ) -> AttributeError:
    """The error for ``owner.name`` missing, for a class's ``__getattr__`` to raise.

    For a name of ``methods`` (Opacus's name -> what to use instead), the message says
    whose name it is (``whose``, e.g. "of Opacus's DPOptimizer") and what to use; any
    other name gets Python's own wording.
    """
    if name in methods:
        return AttributeError(f"{owner} has no {name} ({whose}): use {methods[name]}")
    return AttributeError(f"{owner!r} object has no attribute {name!r}")
