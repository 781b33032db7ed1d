"""Sphinx configuration of the privlearn documentation.

Build (warnings are errors): ``sphinx-build -W --keep-going -b html docs docs/_build/html``.
The API reference is generated before each build by ``docs/apigen.py``; the list of
documented packages is ``apigen.API_PACKAGES``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import apigen  # noqa: E402

import privlearn  # noqa: E402

project = "privlearn"
author = "the privlearn authors"
copyright = "2026, the privlearn authors"
release = version = privlearn.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "README.md"]

# -- API reference --------------------------------------------------------------------
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "none"  # the signature shows them; numpydoc sections describe types
autodoc_inherit_docstrings = False  # scikit-learn's inherited docstrings are not ours
numpydoc_show_class_members = False  # autodoc's :members: lists them
numpydoc_class_members_toctree = False
numpydoc_validation_checks: set[str] = set()  # parse, but do not lint, docstrings
numpydoc_xref_param_type = False

# -- Markdown pages -------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# -- HTML -----------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"privlearn {version}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path: list[str] = []


def _generate_api(app) -> None:
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    _, absent = apigen.present_packages()
    for name in absent:
        why = (f"its dependency {apigen.REQUIRES[name]} is not installed"
               if name in apigen.REQUIRES else "it is not part of this checkout")
        logger.info(f"API reference: {name} is listed in docs/apigen.py but {why}; skipped")
    documented = apigen.generate()
    total = sum(len(v) for v in documented.values())
    logger.info(f"API reference: {total} public names in {len(documented)} packages")


def _skip_foreign_members(app, what, name, obj, skip, options):
    """Members a class inherits or receives from scikit-learn (``set_fit_request`` and
    the like) are scikit-learn's API, documented there, not ours."""
    module = getattr(obj, "__module__", None) or ""
    if module.startswith("sklearn") or (name.startswith("set_") and name.endswith("_request")):
        return True
    return None


def setup(app) -> None:
    app.connect("builder-inited", _generate_api)
    app.connect("autodoc-skip-member", _skip_foreign_members)
