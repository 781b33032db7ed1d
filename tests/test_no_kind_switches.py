"""What privlearn knows about a kind of mechanism lives in the mechanism registry
(:mod:`privlearn.accounting.registry`), and what it knows about a kind of layer in the
layer registries of :mod:`privlearn.torch` (rules, layouts, validators, fixers), never in
an ``isinstance`` chain: no module of the package switches on a registered mechanism
class or on a PyTorch layer type (``isinstance``/``issubclass``, ``type(m) is ...``, a
``match`` class pattern). Structural checks (``Composed``, ``Subsampled``, the
``Mechanism`` base, ``nn.Module`` itself) are not kind switches and are allowed."""

from __future__ import annotations

import ast
from pathlib import Path

import privlearn
import privlearn.compat.autodp  # noqa: F401  (registers every kind the facade defines)
from privlearn.accounting import registry

PKG = Path(privlearn.__file__).parent
AREAS = ["."]  # the whole package
#: where kinds are registered: the registry itself and the built-in kinds' registrations
REGISTRY_MODULES = {"accounting/registry.py", "accounting/_builtin_kinds.py"}


def kind_names() -> set[str]:
    return {cls.__name__ for cls in registry.registered_kinds()}


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def kind_switches(path: Path, kinds: set[str]) -> list[tuple[int, str]]:
    """(line, source) of every switch on a kind in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    hits = []
    for node in ast.walk(tree):
        found: set[str] = set()
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            found = _names(node.args[1]) & kinds
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and (
                isinstance(node.left.func, ast.Name) and node.left.func.id == "type"):
            found = set().union(*(_names(c) for c in node.comparators)) & kinds
        elif isinstance(node, ast.MatchClass):
            found = _names(node.cls) & kinds
        if found:
            hits.append((node.lineno, ast.get_source_segment(path.read_text(), node) or ""))
    return hits


def _files(area: str) -> list[Path]:
    p = (PKG / area).resolve()
    return [p] if p.is_file() else sorted(p.rglob("*.py"))


def test_the_kinds_are_known():
    assert {"Gaussian", "Laplace", "PureDP", "RandomizedResponse", "RDPMechanism"} <= kind_names()


def test_no_isinstance_on_mechanism_kinds_outside_the_registries():
    kinds = kind_names()
    offenders = {}
    for area in AREAS:
        for f in _files(area):
            rel = str(f.relative_to(PKG.resolve()))
            if rel in REGISTRY_MODULES:
                continue
            hits = kind_switches(f, kinds)
            if hits:
                offenders[rel] = hits
    assert not offenders, offenders


def test_the_scan_finds_a_switch(tmp_path):
    """The scanner is not vacuous: it sees each form of switch."""
    f = tmp_path / "m.py"
    f.write_text(
        "def f(m, acc):\n"
        "    if isinstance(m, (acc.Gaussian, int)):\n        pass\n"
        "    if issubclass(type(m), PureDP | Laplace):\n        pass\n"
        "    if type(m) is RandomizedResponse:\n        pass\n"
        "    match m:\n        case RDPMechanism():\n            pass\n"
        "    if isinstance(m, Composed):\n        pass\n")
    assert [line for line, _ in kind_switches(f, kind_names())] == [2, 4, 6, 9]


def layer_type_names() -> set[str]:
    """Every ``torch.nn`` module class but ``Module`` itself (empty without torch)."""
    try:
        import torch.nn as nn
    except ImportError:  # pragma: no cover - the torch extra is optional
        return set()
    out = set()
    for mod in (nn, nn.modules.batchnorm, nn.modules.instancenorm, nn.modules.dropout,
                nn.modules.rnn, nn.parallel):
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, type) and issubclass(obj, nn.Module) and obj is not nn.Module:
                out.add(name)
    return out


def test_no_isinstance_on_layer_types_outside_the_registries():
    """The PyTorch engine decides by the layer registries (:func:`privlearn.torch.
    register_rule` and its layouts, validators and fixers), never by testing types."""
    layers = layer_type_names()
    if not layers:
        return
    offenders = {}
    for f in _files("torch"):
        hits = kind_switches(f, layers)
        if hits:
            offenders[str(f.relative_to(PKG.resolve()))] = hits
    assert not offenders, offenders


def test_the_layer_scan_finds_a_switch(tmp_path):
    if not layer_type_names():
        return
    f = tmp_path / "m.py"
    f.write_text("def f(m, nn):\n    return isinstance(m, nn.LSTM | nn.MultiheadAttention)\n")
    assert [line for line, _ in kind_switches(f, layer_type_names())] == [2]
