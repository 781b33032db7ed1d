"""A typed error for the budget keywords a :class:`PrivatePipeline` does not take.

Every private estimator takes ``epsilon=`` and ``ledger=``, so a pipeline is naturally
given them too; Python's bare ``TypeError`` ("unexpected keyword argument") does not say
where they go. The decorator keeps ``__init__``'s signature (``functools.wraps``), which
scikit-learn's ``get_params`` reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from privlearn.errors import ParameterTypeError

_WHERE = {
    "ledger": (
        "each private step spends on its own ledger: pass the budget to every private "
        "step (PrivateStandardScaler(..., ledger=budget), AdaSSPRegressor(..., "
        "ledger=budget)); the pipeline then refuses, before its first step reads the "
        "data, a fit whose steps together would exceed the budget"
    ),
    "epsilon": (
        "each private step takes its own epsilon and the pipeline's epsilon_ after fit "
        "is their composition (at most their sum): split your target between the "
        "steps (e.g. 0.25 to the scaler, 0.75 to the model), or choose the split "
        "privately with PrivateSearchCV"
    ),
}


def refuse_step_keywords(init: Callable) -> Callable:
    """Wrap ``PrivatePipeline.__init__`` so that ``epsilon=`` or ``ledger=`` raise a
    :class:`~privlearn.errors.ParameterTypeError` saying where they go; any other
    keyword reaches ``init`` unchanged."""

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        for name, where in _WHERE.items():
            if name in kwargs:
                raise ParameterTypeError(
                    f"{type(self).__name__} takes no {name}= (got {name}={kwargs[name]!r}); {where}"
                )
        return init(self, *args, **kwargs)

    return checked
