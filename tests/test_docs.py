"""The documentation site: it builds with warnings as errors, its API reference has an
entry for every public name of the documented packages, and every code block of its pages
runs (so tutorials and guides cannot rot).

* The reference: ``docs/apigen.py`` lists the documented packages (``API_PACKAGES``); the
  site is built into a temporary directory with ``sphinx-build -W`` and every name of each
  package's ``__all__`` must have its page with the object's anchor. A new public name
  without a page, or one whose docstring breaks the build, fails here.
* The pages: the Python blocks of each page under ``docs/`` run in order in one fresh
  interpreter per page; their shell blocks run like README.md's (tests/test_readme.py),
  skipping ``pip install``, ``python -m pytest`` and ``sphinx-build`` (the build is tested
  above). A block preceded by ``<!-- docs-test: skip -->`` is not run.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import apigen  # noqa: E402
from test_readme import readme_blocks, shell_commands  # noqa: E402

sphinx = pytest.importorskip("sphinx", reason="the docs extra is not installed")

REQUIRED = ["privlearn.accounting", "privlearn.models", "privlearn.torch", "privlearn.errors"]
SKIPPED = (("pip", "install"), ("python", "-m", "pytest"), ("sphinx-build",))


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("html")
    p = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                        "html", str(DOCS), str(out)], capture_output=True, text=True,
                       timeout=1800, cwd=ROOT)
    assert p.returncode == 0, f"docs build failed (warnings are errors):\n{p.stderr[-6000:]}"
    return out


def test_package_list_covers_the_required_packages() -> None:
    present, _ = apigen.present_packages()
    for name in REQUIRED:
        assert name in apigen.API_PACKAGES
        if name == "privlearn.torch" and importlib.util.find_spec("torch") is None:
            continue
        assert name in present


def test_reference_page_for_every_public_name(built_site: Path) -> None:
    present, _ = apigen.present_packages()
    if importlib.util.find_spec("torch") is None:
        present = [p for p in present if p != "privlearn.torch"]
    checked = 0
    for package in present:
        names = apigen.public_names(package)
        assert names, package
        summary = (built_site / "api" / "generated" / f"{package}.html").read_text()
        for name in names:
            page = built_site / "api" / "generated" / f"{package}.{name}.html"
            assert page.is_file(), f"no reference page for {package}.{name}"
            html = page.read_text()
            assert f'id="{package}.{name}"' in html, f"{package}.{name}: no documented object"
            assert f"{package}.{name}.html" in summary
            checked += 1
    assert checked >= 50


def _doc_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md")
                  if "_build" not in p.parts and p.name not in ("benchmarks.md",))


def _runnable(page: Path):
    blocks = readme_blocks(page)
    lines = page.read_text().splitlines()
    out = []
    for b in blocks:
        prev = next((lines[k] for k in range(b.line - 2, -1, -1) if lines[k].strip()), "")
        if "docs-test: skip" in prev:
            continue
        out.append(b)
    return out


PAGES = [p for p in _doc_pages() if any(b.lang in ("python", "bash") for b in _runnable(p))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path) -> None:
    blocks = _runnable(page)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    py = [b for b in blocks if b.lang == "python"]
    if py:
        if any("import torch" in b.code for b in py):
            pytest.importorskip("torch")
        rel = page.relative_to(ROOT)
        script = ["ns = {'__name__': '__docs__'}"]
        for b in py:
            script.append(f"exec(compile({b.code!r}, {f'{rel} (block at line {b.line})'!r}, "
                          "'exec'), ns)")
        p = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, p.stderr[-6000:]
        assert p.stdout.strip()
    for b in blocks:
        if b.lang != "bash":
            continue
        for words in shell_commands(b.code):
            if any(tuple(words[: len(s)]) == s for s in SKIPPED):
                continue
            assert words[0] == "privlearn", f"{page}:{b.line}: unknown command {words!r}"
            p = subprocess.run([sys.executable, "-m", "privlearn", *words[1:]], cwd=tmp_path,
                               env=env, capture_output=True, text=True, timeout=1800)
            assert p.returncode == 0, f"{page}:{b.line}: {words}\n{p.stderr}"


def test_cli_guide_equivalence_is_true() -> None:
    """The guide's worked example: B=512, N=50000, 30 epochs = rate 0.01024, 2940 steps."""
    from privlearn.accounting import Gaussian, compose, subsample

    eps = compose(subsample(Gaussian(1.0), 0.01024), steps=2940).epsilon(1e-5)
    assert round(eps, 4) == 3.2434
    assert "3.2434" in (DOCS / "guides" / "cli.md").read_text()
