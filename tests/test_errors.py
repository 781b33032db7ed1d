"""Every exception and warning class lives in :mod:`privlearn.errors`; the packages that
raise them re-export the same class objects."""

from __future__ import annotations

import ast
import builtins
import functools
import pickle
from pathlib import Path

import pytest

import privlearn
from privlearn import errors

PKG = Path(privlearn.__file__).parent

#: Exception classes still defined outside errors.py, each owned by another part of the
#: package (listed so that a new one fails this test; remove an entry once it has moved).
KNOWN_ELSEWHERE: set[tuple[str, str]] = set()
#: Private control-flow signals that never leave their module.
PRIVATE_SIGNALS = {("accounting/pld.py", "_TooLarge"), ("accounting/pld.py", "_NoTiltGain")}

_BUILTIN_EXCEPTIONS = {
    name for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}


def _base_names(node: ast.ClassDef) -> set[str]:
    out = set()
    for b in node.bases:
        if isinstance(b, ast.Name):
            out.add(b.id)
        elif isinstance(b, ast.Attribute):
            out.add(b.attr)
    return out


@functools.cache
def _exception_classes() -> frozenset[tuple[str, str]]:
    """(file, class) of every class defined in privlearn whose base is a built-in
    exception, a class of privlearn.errors, or another class found here (read once per
    process: the two tests below share it)."""
    known = set(_BUILTIN_EXCEPTIONS) | set(errors.__all__) | {"ClickException"}
    found: set[tuple[str, str]] = set()
    trees = {str(p.relative_to(PKG)): ast.parse(p.read_text()) for p in PKG.rglob("*.py")}
    changed = True
    while changed:  # subclasses of subclasses
        changed = False
        for rel, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and _base_names(node) & known:
                    if (rel, node.name) not in found:
                        found.add((rel, node.name))
                        known.add(node.name)
                        changed = True
    return frozenset(found)


def test_every_exception_class_lives_in_errors():
    outside = {c for c in _exception_classes() if c[0] != "errors.py"}
    assert outside <= KNOWN_ELSEWHERE | PRIVATE_SIGNALS, outside - KNOWN_ELSEWHERE
    # an entry whose file is here but whose class has moved must be removed from the list
    stale = {c for c in KNOWN_ELSEWHERE | PRIVATE_SIGNALS
             if (PKG / c[0]).exists() and c not in outside}
    assert not stale, stale


def test_errors_defines_exactly_its_public_names():
    defined = {n for f, n in _exception_classes() if f == "errors.py"}
    assert defined == set(errors.__all__)


@pytest.mark.parametrize(("module", "names"), [
    ("privlearn.accounting", ["AccountingError", "CertificationError", "CalibrationError",
                              "PrivacyLossOverflowError", "UnsupportedMechanismError"]),
    ("privlearn.ledger", ["LedgerIntegrityError", "LedgerNotFoundError",
                          "UnknownBudgetError", "LedgerConflictError"]),
    ("privlearn.datasets", ["DataNotFoundError"]),
    ("privlearn.compat.autodp.autodp_core", ["AutodpArgumentWarning"]),
    ("privlearn.models", ["DataClippedWarning"]),
    ("privlearn.torch", ["PrivacyBudgetWarning", "UnsupportedModuleError",
                         "BatchDependenceError", "NonFiniteInputError",
                         "UntestedTorchWarning", "TrainingLoopError"]),
])
def test_public_homes_re_export_the_same_classes(module, names):
    import importlib

    mod = importlib.import_module(module)
    for name in names:
        assert getattr(mod, name) is getattr(errors, name), (module, name)


def test_errors_subclass_the_builtin_that_fits():
    assert issubclass(errors.ParameterValueError, ValueError)
    assert issubclass(errors.ParameterTypeError, TypeError)
    assert issubclass(errors.ParameterTypeError, ValueError)
    assert issubclass(errors.CertificationError, errors.AccountingError)
    assert issubclass(errors.PrivacyLossOverflowError, OverflowError)
    assert issubclass(errors.AccountingError, ArithmeticError)
    assert issubclass(errors.UnknownBudgetError, KeyError)
    assert issubclass(errors.LedgerNotFoundError, FileNotFoundError)
    assert issubclass(errors.BudgetExceededError, errors.PrivacyBudgetExceededError)


def test_unknown_budget_message_is_not_quoted_and_errors_pickle():
    e = errors.UnknownBudgetError("no budget for dataset 'a'")
    assert str(e) == "no budget for dataset 'a'"
    t = errors.LedgerIntegrityError("tampered", ("entry 2 is missing",))
    t2 = pickle.loads(pickle.dumps(t))
    assert str(t2) == "tampered"


#: Layers and modules whose public refusals are typed (privlearn.errors); the autodp
#: facade raises typed subclasses of what autodp raises.
TYPED_LAYERS = ("accounting", "models", "ledger", "experiments", "cli", "datasets.py",
                "demo.py", "auditing", "torch", "correlated", "data", "_validation.py",
                "_type_registry.py", "compat/autodp")
NOT_YET_TYPED: set[str] = set()


def test_public_refusals_are_typed_errors():
    """No plain ``raise ValueError``/``TypeError``/``RuntimeError`` in the typed layers
    (the autodp facade's subclass the errors autodp raises): a caller catches
    privlearn's refusals by type (each typed error still subclasses the built-in)."""
    plain = []
    for layer in TYPED_LAYERS:
        root = PKG / layer
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            rel = path.relative_to(PKG).as_posix()
            if rel in NOT_YET_TYPED:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                        and isinstance(node.exc.func, ast.Name)
                        and node.exc.func.id in ("ValueError", "TypeError",
                                                 "RuntimeError")):
                    plain.append(f"{rel}:{node.lineno} {node.exc.func.id}")
    assert not plain, plain


@pytest.mark.parametrize(("cls", "base"), [
    (errors.ConfigurationError, ValueError), (errors.ParameterValueError, ValueError),
    (errors.ParameterTypeError, ValueError), (errors.ParameterTypeError, TypeError),
    (errors.DataFormatError, ValueError), (errors.PrivacyLossOverflowError, OverflowError),
    (errors.TrainingLoopError, RuntimeError), (errors.PlanMismatchError, RuntimeError),
    (errors.PlanMismatchError, ValueError),
])
def test_typed_errors_are_the_builtins_callers_already_catch(cls, base):
    assert issubclass(cls, base)
