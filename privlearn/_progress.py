"""The one progress bar of privlearn: a ``tqdm`` bar on standard error.

Every long-running public entry point (a search's fits, an estimator's iterations, an
experiment's runs, a strategy's optimisation, an audit's training steps) shows its
progress through :func:`progress`, so that they all follow one convention:

* the bar goes to **standard error**, never into a returned value or standard output;
* ``enabled=None`` (the default of the ``show_progress=`` parameters): shown only when
  standard error is a terminal -- never in a log file, a pipe, a notebook's captured
  stream or a test -- and, with ``delay=``, only once the work has lasted that long;
* ``enabled=True``: shown whatever standard error is, from the start (no delay);
* ``enabled=False``: nothing is written.

The estimators' ``verbose`` (scikit-learn's convention: 0 silent) maps to
``enabled=bool(verbose)``.
"""

from __future__ import annotations

import sys

from privlearn.errors import ParameterTypeError

__all__ = ["check_show_progress", "progress", "stderr_is_terminal"]


def stderr_is_terminal() -> bool:
    """Whether the current standard error is a terminal (read at call time, so a
    redirected or captured ``sys.stderr`` counts as not one)."""
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed stream
        return False


def check_show_progress(show_progress: object, name: str = "show_progress") -> bool | None:
    """``show_progress`` as None (a bar on a terminal only), True or False, else a
    :class:`~privlearn.errors.ParameterTypeError` naming ``name``."""
    if show_progress is None:
        return None
    if isinstance(show_progress, bool) or type(show_progress).__name__ == "bool_":
        return bool(show_progress)
    raise ParameterTypeError(
        f"{name} must be None (a progress bar when standard error is a terminal), True "
        f"(always) or False (never), got {type(show_progress).__name__} {show_progress!r}")


def progress(iterable=None, *, total: float | None = None, desc: str = "",
             unit: str = "it", enabled: bool | None = None, delay: float = 0.0,
             leave: bool = False):
    """A ``tqdm`` bar over ``iterable`` (or a manual one of ``total`` steps, ``None`` for
    a counter) on standard error.

    Parameters
    ----------
    iterable : iterable, optional
        Wrapped and yielded unchanged.
    total : float, optional
        The number of steps of a manual bar (``bar.update(k)``); None: a counter.
    desc, unit : str
        The bar's label and the unit of its steps.
    enabled : bool or None
        True: shown; False: nothing written; None: shown only when standard error is a
        terminal (:func:`stderr_is_terminal`), and only after ``delay`` seconds.
    delay : float
        Seconds before an automatic (``enabled=None``) bar first appears: quick work
        stays silent. An explicit ``enabled=True`` shows the bar at once.
    leave : bool
        Keep the finished bar on screen.

    Returns
    -------
    tqdm.tqdm
        Also a context manager; disabled (writes nothing) when not shown.
    """
    from tqdm import tqdm

    auto = enabled is None
    shown = stderr_is_terminal() if auto else bool(enabled)
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not shown,
                file=sys.stderr, dynamic_ncols=True, leave=leave,
                delay=float(delay) if auto else 0.0)
