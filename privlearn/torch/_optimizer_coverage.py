"""The optimizer's coverage of the model's trainable parameters, checked by
:func:`privlearn.torch.privacy_engine.prepare_model` (private helper)."""

from __future__ import annotations

import warnings

from torch import nn

from privlearn.errors import ConfigurationError
from privlearn.torch.fsdp import is_sharded

__all__ = ["warn_unoptimised"]


def warn_unoptimised(model: nn.Module, optimizer) -> None:
    """Refuse an optimizer that holds none of the model's trainable parameters (built over
    another model's); warn about trainable parameters of the model that no param group of
    the optimizer holds: the engine clips every trainable parameter (their gradients count in each
    example's norm, so the optimised ones are clipped harder) and the optimizer never
    updates them."""
    held = {id(q) for g in optimizer.param_groups for q in g["params"]}
    trainable = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    names = [n for n, q in trainable if id(q) not in held]
    if trainable and len(names) == len(trainable):
        if is_sharded(model):  # the sharded checks name an optimizer built before fully_shard
            return
        raise ConfigurationError(
            f"the optimizer holds none of the model's {len(trainable)} trainable parameters "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): it was built over "
            "other tensors (a copy of the model, or the model before a change that replaced "
            "its parameters), so no step would update the model while every step would be "
            "accounted. Build the optimizer over model.parameters() of the model passed "
            "to make_private"
        )
    if names:
        warnings.warn(
            "trainable parameters of the model in no param group of the optimizer "
            f"({len(names)}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): the DP "
            "engine clips every trainable parameter, so their gradients count in each "
            "example's norm (the optimised parameters are clipped harder) and get noise, "
            "while the optimizer never updates them. Freeze them (requires_grad_(False)) to "
            "clip only what is trained, or add them to the optimizer",
            UserWarning,
            stacklevel=4,
        )
