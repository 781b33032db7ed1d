"""Parameters a layer keeps in a parameter container and uses in its own forward.

A container (``nn.ParameterDict``, ``nn.ParameterList``: a submodule without a forward
of its own and without submodules) is never called, so it cannot be a unit: its
parameters are used by the module holding it. peft's adapters keep their trained tensors
so, one entry per adapter name: LoRA on an embedding (``lora_embedding_A``,
``lora_embedding_B``, used through ``F.embedding`` and a matrix product), IA3
(``ia3_l``, a scaling of the input or output), LoHa (``hada_w1_a``, ...), VeRA
(``vera_lambda_b``, ``vera_lambda_d``). Such a parameter was refused as "used outside its
layer". A module below the root without a rule of its own now holds them in its unit:
the torch.func fallback differentiates the module's call with respect to them, example
by example (:mod:`privlearn.torch.fallback`), which the batch-independence probe checks
like any fallback layer. At the root (a model whose forward reads a container) they stay
refused: the fallback would be the whole model's forward.
"""

from __future__ import annotations

from torch import nn

from privlearn.torch._aliases import own_parameters

__all__ = ["held_parameters"]


def _is_container(m: nn.Module) -> bool:
    """``m`` holds parameters and cannot be called: no forward, no submodules."""
    return type(m).forward is nn.Module.forward and not m._modules and bool(m._parameters)


def held_parameters(module: nn.Module, name: str, covered: set) -> tuple:
    """The trainable parameters of ``module``'s unit: its own
    (:func:`~privlearn.torch._aliases.own_parameters`) and those of its parameter
    containers, whose qualified names are added to ``covered`` (no unit of their own).
    ``name``: ``module``'s qualified name (``""``, the root: its own only)."""
    own = own_parameters(module)
    if not name:
        return own
    seen = {id(p) for p in own}
    held = []
    for child_name, child in module.named_children():
        if not _is_container(child):
            continue
        covered.add(f"{name}.{child_name}")
        for p in child._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                held.append(p)
    return (*own, *held)
