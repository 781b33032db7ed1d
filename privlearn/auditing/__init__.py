"""Empirical privacy auditing: lower bounds on epsilon from canaries.
"""
from privlearn.auditing.bounds import METHODS, auc, epsilon_lower_bound, roc_curve, tpr_at_fpr
