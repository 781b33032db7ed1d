"""Names of Opacus that privlearn does not have (privlearn._opacus_names): importing one
from privlearn.torch or privlearn.accounting says what to use instead, in the error that
``from ... import`` shows; any other missing name keeps Python's own errors."""

from __future__ import annotations

import importlib
import re

import pytest

from privlearn._opacus_names import OPACUS_NAMES

#: Where each name lives in Opacus 1.x (checked against an installed Opacus below).
_OPACUS_HOMES = {
    "PrivacyEngine": "opacus",
    "GradSampleModule": "opacus",
    "GradSampleModuleFastGradientClipping": "opacus.grad_sample",
    "BatchMemoryManager": "opacus.utils.batch_memory_manager",
    "DPDataLoader": "opacus.data_loader",
    "UniformWithReplacementSampler": "opacus.utils.uniform_sampler",
    "get_noise_multiplier": "opacus.accountants.utils",
    "ModuleValidator": "opacus.validators",
    "RDPAccountant": "opacus.accountants",
    "PRVAccountant": "opacus.accountants",
    "GaussianAccountant": "opacus.accountants",
    "AdaClipDPOptimizer": "opacus.optimizers",
    "DPPerLayerOptimizer": "opacus.optimizers",
    "DPLSTM": "opacus.layers",
    "DPGRU": "opacus.layers",
    "DPRNN": "opacus.layers",
    "DPMultiheadAttention": "opacus.layers",
    "register_grad_sampler": "opacus.grad_sample",
    "register_norm_sampler": "opacus.grad_sample",
    "check_per_sample_gradients_are_correct": "opacus.utils.per_sample_gradients_utils",
    "GradSampleModuleExpandedWeights": "opacus.grad_sample",
    "GradSampleModuleNoOp": "opacus.grad_sample",
    "DifferentiallyPrivateDistributedDataParallel": "opacus.distributed",
    "DistributedDPOptimizer": "opacus.optimizers",
    "SimpleDistributedPerLayerOptimizer": "opacus.optimizers",
    "DPOptimizerFastGradientClipping": "opacus.optimizers",
    "DistributedDPOptimizerFastGradientClipping": "opacus.optimizers",
    "FSDPOptimizerFastGradientClipping": "opacus.optimizers",
    "DPLossFastGradientClipping": "opacus.utils.fast_gradient_clipping_utils",
    "wrap_data_loader": "opacus.utils.batch_memory_manager",
    "ExponentialNoise": "opacus.schedulers",
    "StepNoise": "opacus.schedulers",
    "LambdaNoise": "opacus.schedulers",
    "ExponentialGradClip": "opacus.schedulers",
    "StepGradClip": "opacus.schedulers",
    "LambdaGradClip": "opacus.schedulers",
    "IAccountant": "opacus.accountants",
}


def _modules():
    mods = ["privlearn.accounting"]
    try:
        import torch  # noqa: F401
    except ImportError:
        return mods
    return [*mods, "privlearn.torch"]


def test_the_table_lists_names_of_opacus():
    assert set(_OPACUS_HOMES) == set(OPACUS_NAMES)
    pytest.importorskip("opacus")
    for name, home in _OPACUS_HOMES.items():
        assert hasattr(importlib.import_module(home), name), (home, name)


@pytest.mark.parametrize("module", _modules())
def test_from_import_of_an_opacus_name_says_what_to_use(module):
    mod = importlib.import_module(module)
    for name, use in OPACUS_NAMES.items():
        with pytest.raises(ImportError) as err:
            exec(f"from {module} import {name}", {})
        msg = str(err.value)
        assert f"{module} has no {name}" in msg and use in msg
        # the guide by its title: an installed package has no docs/ folder
        assert "coming from Opacus" in msg and "docs/" not in msg
        # attribute access: an AttributeError with the same words, so that hasattr and
        # getattr with a default behave as for any missing attribute
        with pytest.raises(AttributeError, match=re.escape(f"{module} has no {name}")):
            getattr(mod, name)
        assert not hasattr(mod, name) and getattr(mod, name, None) is None


@pytest.mark.parametrize("module", _modules())
def test_other_missing_names_keep_pythons_errors(module):
    mod = importlib.import_module(module)
    with pytest.raises(ImportError, match=f"cannot import name 'NoSuchName' from '{module}'"):
        exec(f"from {module} import NoSuchName", {})
    with pytest.raises(AttributeError, match=f"module '{module}' has no attribute 'x_y'"):
        mod.x_y  # noqa: B018
    assert not hasattr(mod, "__wrapped__")


def test_what_the_messages_name_exists():
    """Every privlearn name a message recommends is importable where it says."""
    pytest.importorskip("torch")
    named = set()
    for use in OPACUS_NAMES.values():
        named |= set(re.findall(r"privlearn\.(torch|accounting)\.(\w+)", use))
    assert ("torch", "make_private") in named and ("accounting", "calibrate") in named
    for module, name in named:
        assert hasattr(importlib.import_module(f"privlearn.{module}"), name), (module, name)
