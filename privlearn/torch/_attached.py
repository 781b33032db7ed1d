"""Which modules carry a tracker's hooks: one private training run per layer.

:func:`check_not_attached` refuses a model (or a part of one) given to a second engine
while the first one's hooks are on it.
"""

from __future__ import annotations

import weakref

from torch import nn

from privlearn.errors import ConfigurationError

#: ``module -> weak reference to the tracker whose hooks are on it`` (every module of an
#: attached tracker's model, until :meth:`GradSampleTracker.detach`)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_not_attached(model: nn.Module) -> None:
    """Refuse a model any of whose modules already carries a tracker's hooks (a model
    given to :func:`~privlearn.torch.make_private` twice, or containing, or contained in,
    one already made private): a second engine would record every forward twice, and
    each would find the other's records at its step.

    Raises
    ------
    ConfigurationError
    """
    names = {m: n for n, m in model.named_modules()}
    for module, name in names.items():
        ref = _ATTACHED.get(module)
        if ref is not None and ref() is not None:
            where = "the model" if not name else f"its submodule {name!r}"
            raise ConfigurationError(
                f"{where} is already attached to a private training run (an earlier "
                "make_private, or a GradSampleTracker, on this model or on a model "
                "containing it): a second engine on the same layers would record every "
                "forward pass twice and neither step could clip what it recorded. Keep "
                "training with the earlier run's p.optimizer and p.data_loader, or call "
                "p.detach() on it first (a DPTrainer's: trainer.privacy_engine.detach(); "
                "it removes its hooks and returns the model), then make_private again: "
                "the new run's epsilon covers its own steps only, so compose it with the "
                "earlier run's. Nothing was changed"
            )
