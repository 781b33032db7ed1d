"""Messages point to what an installed package has.

A ``pip install``-ed privlearn has no ``docs/`` folder, so an error, warning or hint that
names a file there sends the user nowhere; messages name a guide by its title (and
section) or a ``help(...)`` / ``--help`` instead. Docstrings and comments are read with the
source tree at hand and may name the pages' files.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "privlearn"


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _message_strings(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs):
            yield node.lineno, node.value


def test_the_scan_sees_string_literals_and_skips_docstrings(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""see docs/a.md"""\n\ndef f():\n    """docs/b.md"""\n'
                   '    raise ValueError("see " "docs/c.md")\n')
    assert [value for _, value in _message_strings(src)] == ["see docs/c.md"]


def test_no_string_literal_of_the_package_names_a_docs_file():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {value[:80]!r}"
             for path in files for line, value in _message_strings(path)
             if "docs/" in value or "docs\\" in value]
    assert not found, "\n".join(found)
