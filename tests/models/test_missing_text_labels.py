"""Text labels with missing entries get the estimators' refusal of a missing label.

A pandas ``string`` column read with missing entries holds ``pandas.NA``, and a
``category`` column a NaN: scikit-learn's checks of such a ``y`` failed with "boolean
value of NA is ambiguous" (a ``ParameterTypeError``) or "Input contains NaN", naming
neither ``y`` nor what to do, where ``None`` among text labels and ``pandas.NA`` in a
numeric ``y`` are refused saying so.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from privlearn.errors import NonFiniteInputError
from privlearn.models import DPSGDClassifier, PrivateKNN, PrivatePipeline, PrivateSearchCV

RNG = np.random.default_rng(0)
X = RNG.normal(size=(60, 2)) / 3.0
TEXT = np.where(X[:, 0] > 0, "yes", "no").astype(object)
TEXT[[3, 17]] = None

LABELS = {
    "string": pd.array(TEXT, dtype="string"),  # pandas.NA
    "string-series": pd.Series(pd.array(TEXT, dtype="string")),
    "category": pd.Series(pd.Categorical(TEXT, categories=["no", "yes"])),  # NaN
}


def _clf():
    return DPSGDClassifier(n_iter=3, classes=["no", "yes"])


FITS = {
    "DPSGDClassifier": lambda X, y: _clf().fit(X, y),
    "PrivateKNN": lambda X, y: PrivateKNN(classes=["no", "yes"]).fit(X, y),
    "PrivatePipeline": lambda X, y: PrivatePipeline([("model", _clf())]).fit(X, y),
    "PrivateSearchCV": lambda X, y: PrivateSearchCV(_clf(), {"learning_rate": [0.5]}).fit(X, y),
}


@pytest.mark.parametrize("labels", list(LABELS))
@pytest.mark.parametrize("fit", list(FITS))
def test_a_missing_text_label_is_refused_naming_y_and_what_to_do(fit, labels):
    y = LABELS[labels]
    assert int(pd.Series(y).isna().sum()) == 2  # the premise, as pandas counts it
    with pytest.raises(NonFiniteInputError, match=r"Input y contains a missing label") as info:
        FITS[fit](X, y)
    assert "drop the rows without a label" in str(info.value)


@pytest.mark.parametrize("fit", list(FITS))
def test_the_same_labels_without_the_missing_rows_fit(fit):
    keep = ~pd.isna(TEXT)
    FITS[fit](X[keep], pd.array(TEXT[keep], dtype="string"))
