"""Empirical privacy auditing: lower bounds on epsilon from canaries.

Every privacy number privlearn reports is a proof about the algorithm as specified; an
audit is an experiment on the code as it runs. Insert canaries, train once, score them,
and bound epsilon from below (:func:`one_run_audit`); a bound above the accountant's
epsilon proves (at the stated confidence) that the run leaks more than it claims.

* :func:`epsilon_lower_bound` -- bounds from canary scores: ``"one_run"`` (Steinke, Nasr
  & Jagielski 2023), ``"one_run_fdp"`` (Mahloujifar, Melis & Chaudhuri 2025),
  ``"clopper_pearson"`` (Jagielski, Ullman & Oprea 2020; Nasr et al. 2021), ``"gdp"``
  (Nasr et al. 2023); see :mod:`privlearn.auditing.bounds`.
* :func:`roc_curve`, :func:`auc`, :func:`tpr_at_fpr` -- the attack's ROC;
  :func:`accountant_roc` (from :func:`privlearn.accounting.fdp.tradeoff_curve`) -- the
  best ROC the accountant allows, to plot beside it.
* :func:`one_run_audit` -- the harness: draw inclusion, train and score, bound.
* :mod:`privlearn.auditing.torch` (imported lazily: torch) -- Dirac gradient canaries
  and loss scores for :func:`privlearn.torch.make_private`, :func:`audit_dpsgd` (the
  engine's own audit) and :func:`audit_training` (your model and training loop, in one
  call).
* :mod:`privlearn.auditing.models` -- canaries for the NumPy estimators.

A lower bound proves a leak when it exceeds the claim; a bound below the claim proves
nothing about privacy (a weak attack, too few canaries). See ``docs/guides/auditing.md``.

NumPy/SciPy only at import time.
"""

from privlearn.auditing.bounds import METHODS, auc, epsilon_lower_bound, roc_curve, tpr_at_fpr
from privlearn.auditing.harness import ONE_RUN_METHODS, AuditResult, one_run_audit
from privlearn.auditing.report import accountant_roc

__all__ = [
    "METHODS",
    "ONE_RUN_METHODS",
    "AuditResult",
    "accountant_roc",
    "auc",
    "epsilon_lower_bound",
    "one_run_audit",
    "roc_curve",
    "tpr_at_fpr",
]
