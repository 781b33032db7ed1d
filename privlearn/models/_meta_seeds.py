"""Copies of one seeded private estimator fitted within one call of a scikit-learn
meta-estimator (private helper of :mod:`privlearn.models._meta_guard`).

``sklearn.base.clone`` copies an estimator's parameters: an integer ``random_state`` is
copied as it is, and a ``Generator`` or ``RandomState`` is deep-copied in its current
state. A meta-estimator that fits several copies of a private estimator seeded so
(``MultiOutputRegressor``, ``OneVsRestClassifier``, ``cross_val_predict``, ``RFE``,
``GridSearchCV``, ...) therefore fits them all with the very same noise draws, whatever
the data each copy sees: a combination of their releases (two outputs' coefficients,
two folds' fits on overlapping rows) cancels the noise, which the composition of their
``mechanism_`` (independent noise draws) does not cover. scikit-learn users commonly set
``random_state=42`` on every estimator, so this is warned of
(:class:`~privlearn.errors.PrivacyLeakWarning`), once per call of the meta-estimator's
``fit``, when a second fit within that call starts from the same noise source as an
earlier one (compared as :mod:`privlearn.models._shared_noise` compares a pipeline's
steps), and when ``clone`` copies it within such a call: a second copy of one object
with the same seed is warned of there (so that copies fitted in joblib's workers,
``n_jobs`` > 1, are seen), except where the copies are seeded after the copy (an
ensemble's ``_make_estimator``, a search or ``validation_curve`` whose candidates set
``random_state``). Ensembles that
give each copy its own seed (bagging with its ``random_state`` set) draw distinct noise
and are not warned of. The steps of one
:class:`~privlearn.models.PrivatePipeline` fit are not copies: that pipeline warns of
steps seeded alike itself (:mod:`privlearn.models._shared_noise`), so only the steps of
two of its fits (two folds) are compared. Copies made and fitted in joblib's workers
(``MultiOutputRegressor``, ``OneVsRestClassifier`` with ``n_jobs`` > 1) are not seen.
"""

from __future__ import annotations

import collections
import copy
import numbers
import pickle
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np

__all__ = ["copies_seeded_alike"]

#: the id of a call's frame -> (that frame, whether warned, the noise sources' first
#: states seen in the call, each with the fits that started from it: the estimator's
#: class name and the private container fitting it, held so that its id is not reused),
#: most recent last
_SEEN: collections.OrderedDict[
    int, tuple[FrameType, list[bool], dict[bytes, list[tuple[str, Any]]]]
] = collections.OrderedDict()
_LOCK = threading.Lock()


def _seed_state(estimator: Any, rng_of: Callable[[Any], Any]) -> bytes | None:
    """The first state of the generator ``rng_of`` makes from ``estimator``'s own
    ``random_state`` (each step of a pipeline is fitted, and checked, on its own), read
    from a copy; None for a source drawing fresh entropy (None)."""
    source = getattr(estimator, "random_state", None)
    fixed = (isinstance(source, numbers.Integral) and not isinstance(source, bool)) or (
        isinstance(source, np.random.Generator | np.random.RandomState)
    )
    if not fixed:
        return None
    return pickle.dumps(rng_of(copy.deepcopy(source)).bit_generator.state)


def copies_seeded_alike(
    owner: str,
    estimator: Any,
    rng_of: Callable[[Any], Any],
    kind: str,
    frame: FrameType,
    *,
    group: Any = None,
    source: Any = None,
) -> str | None:
    """The warning to give when a fit of ``estimator`` (named ``owner``) within the call
    running in ``frame`` starts its noise as an earlier fit within that call did (None:
    it does not, or that call was warned of already).

    Parameters
    ----------
    owner : str
        The private estimator's class name.
    estimator : PrivateEstimator
        The copy being fitted.
    rng_of : callable
        How its fit makes its generator from ``random_state``
        (:func:`privlearn.models.base.make_rng`).
    kind : str
        What fits the copies: the outermost scikit-learn meta-estimator's class name, or
        a cross-validation function's name (``cross_val_predict``).
    frame : frame
        The frame of that meta-estimator's ``fit`` call, or of that function's call (the
        call's identity).
    group : PrivatePipeline, optional
        The private container whose fit fits ``estimator`` as a step: an earlier step of
        the same container fit seeded alike is that container's own warning, not a copy.
    source : PrivateEstimator, optional
        Given when ``estimator`` is being cloned (``sklearn.base.clone``, the copy made
        in the meta-estimator's own thread before joblib hands it to a worker whose
        frames do not show the call): a second copy of that same object with the same
        seed within the call is warned of. A clone alone is not compared with fits.
    """
    state = _seed_state(estimator, rng_of)
    if state is None:
        return None
    key = id(frame)
    with _LOCK:
        _drop_finished()
        entry = _SEEN.get(key)
        if entry is None:
            entry = _SEEN[key] = (frame, [False], {})
            while len(_SEEN) > 256:
                _SEEN.popitem(last=False)
        _, warned, seen = entry
        if source is not None:  # copies of one object (held: its id is not reused)
            slot = b"clone:" + state
            earlier = [name for name, g in seen.get(slot, []) if g is source]
            seen.setdefault(slot, []).append((owner, source))
        else:
            earlier = [name for name, g in seen.get(state, []) if group is None or g is not group]
            seen.setdefault(state, []).append((owner, group))
        if not earlier or warned[0]:
            return None
        warned[0] = True
    fits = f"{owner} several times" if earlier[0] == owner else f"{earlier[0]} and {owner}"
    return (
        f"{kind} fits {fits} with noise that starts alike (one "
        "random_state, copied to each copy by sklearn.base.clone or given to each "
        "estimator): the fits draw the same noise, so their releases can be combined to "
        "cancel it, which each fit's mechanism_ (independent noise) does not cover. Leave "
        "random_state=None on the private estimator (each fit then draws fresh noise); to "
        "reproduce an ensemble, seed the ensemble, which gives each copy its own seed"
    )

def running_frame_ids() -> set[int]:
    """The ids of every frame on some thread's stack now: a recorded call whose frame is
    not among them has returned (and its frame's id may be reused by a later call)."""
    running: set[int] = set()
    for top in sys._current_frames().values():
        walk: FrameType | None = top
        while walk is not None and id(walk) not in running:
            running.add(id(walk))
            walk = walk.f_back
    return running



def _drop_finished() -> None:
    """Forget the calls whose frame is on no thread's stack any more (their fit
    returned: a frame's id is reused by later calls); called under :data:`_LOCK`."""
    if not _SEEN:
        return
    running = running_frame_ids()
    for key in [k for k, (f, _, _) in _SEEN.items() if id(f) not in running]:
        del _SEEN[key]
