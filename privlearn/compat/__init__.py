"""Compatibility layers that let code written for other DP libraries run on privlearn.

* :mod:`privlearn.compat.autodp` -- the ``autodp`` vocabulary (``Mechanism``,
  ``mechanism_zoo``, ``transformer_zoo``, ``calibrator_zoo``) backed by
  :mod:`privlearn.accounting`. Code written for autodp runs after changing only its
  import lines, and gets privlearn's certified (and usually tighter) epsilons.
* :mod:`privlearn.compat.dp_events` -- Google dp_accounting's ``DpEvent`` trees as
  privlearn mechanisms (:func:`~privlearn.compat.dp_events.from_dp_event`).
"""
