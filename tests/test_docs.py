"""The documentation site: it builds with warnings as errors, its API reference has an
entry for every public name of the documented packages, every code block of its pages
runs (so tutorials and guides cannot rot), and its pages read as user documentation.

* The reference: ``docs/apigen.py`` lists the documented packages (``API_PACKAGES``); the
  site is built from a copy of ``docs/`` into a temporary directory with ``sphinx-build
  -W`` (once, on one xdist worker; the checkout is not written) and every name of each
  package's ``__all__`` must have its page with the object's anchor. A new public name
  without a page, or one whose docstring breaks the build, fails here.
* The pages: the Python blocks of each page under ``docs/`` run in order in one fresh
  interpreter per page (one intra-op thread for PyTorch: the pages' models are tiny),
  where a ``PrivacyLeakWarning`` is an error (no page teaches a choice that leaks);
  their shell blocks run like README.md's (tests/test_readme.py), skipping ``pip
  install``, ``python -m pytest`` and ``sphinx-build`` (the build is tested above). A
  block preceded by ``<!-- docs-test: skip -->`` is not run; no tutorial may have one.
* The text of the user pages (every page but the benchmarks, which keep their dates):
  cross-references are links, not plain paths (the build checks that links resolve); no
  development history (issue numbers, dated trials, internal names of past studies); PLD,
  RDP and "dominating pair" are linked to the glossary where a page first uses them; and
  every API role (``{func}``, ``{class}``, ...) resolves to a reference page.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
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

REQUIRED = ["privlearn.accounting", "privlearn.models", "privlearn.torch", "privlearn.torch.hf",
            "privlearn.ledger", "privlearn.auditing", "privlearn.correlated", "privlearn.errors"]
SKIPPED = (("pip", "install"), ("python", "-m", "pytest"), ("sphinx-build",))


#: The tests that read the built site: one xdist work unit, so the site is built once, on
#: one worker (under ``-n`` the tests of a module are otherwise spread over the workers,
#: and each would build it again).
SITE = pytest.mark.xdist_group("docs_site")


#: The environment variable naming a site already built from this checkout with
#: ``sphinx-build -W --keep-going -b html docs <folder>`` (``.ci/run`` builds it before the
#: suite and sets it): the site's tests read that build instead of building it again.
PREBUILT = "PRIVLEARN_DOCS_HTML"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    """The site built from a copy of ``docs/`` beside links to the checkout's other
    top-level entries (the package, ``CHANGELOG.md``, which a page includes): the API
    pages that ``conf.py`` generates land in the copy, not in the checkout, where another
    build (a test's, a person's) deletes and rewrites them while this one reads them.

    Where ``PRIVLEARN_DOCS_HTML`` names a folder, the site built there (by ``.ci/run``,
    with warnings as errors, before the suite) is read instead."""
    prebuilt = os.environ.get(PREBUILT)
    if prebuilt:
        site = Path(prebuilt).resolve()
        assert (site / "index.html").is_file(), f"{PREBUILT}={prebuilt}: no built site there"
        return site
    work = tmp_path_factory.mktemp("site")
    src, out = work / "docs", work / "html"
    shutil.copytree(DOCS, src, ignore=shutil.ignore_patterns("_build", "generated"))
    for entry in ROOT.iterdir():
        if entry.name != "docs" and not entry.name.startswith("."):
            (work / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    p = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                        "html", str(src), str(out)], capture_output=True, text=True,
                       timeout=1800, cwd=work)
    assert p.returncode == 0, f"docs build failed (warnings are errors):\n{p.stderr[-6000:]}"
    return out


def test_package_list_covers_the_required_packages() -> None:
    present, _ = apigen.present_packages()
    for name in REQUIRED:
        assert name in apigen.API_PACKAGES
        dependency = apigen.REQUIRES.get(name)
        if dependency is not None and importlib.util.find_spec(dependency) is None:
            assert name not in present  # skipped, not a failed build
            continue
        assert name in present


@SITE
def test_reference_page_for_every_public_name(built_site: Path) -> None:
    present, _ = apigen.present_packages()
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


TUTORIALS = sorted((DOCS / "tutorials").glob("*.md"))


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


#: Pages run only with ``-m slow`` (none at present). The multi-GPU tutorial's forked gloo
#: processes once hung at exit, about one run in six, in ``ProcessGroupGloo``'s destructor
#: (a worker thread waiting for the GIL to release a tensor of privlearn's last all-reduce);
#: privlearn's collectives now return once the worker let go of their tensors
#: (tests/torch/test_gloo_teardown.py), and the page runs in the default suite again.
SLOW_PAGES: set[str] = set()


@pytest.mark.parametrize(
    "page", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p
             for p in PAGES], ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path) -> None:
    blocks = _runnable(page)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    py = [b for b in blocks if b.lang == "python"]
    if py:
        if any("import torch" in b.code for b in py):
            pytest.importorskip("torch")
        rel = page.relative_to(ROOT)
        # a page never teaches a choice that leaks: PrivacyLeakWarning is an error
        script = [NO_LEAK, "ns = {'__name__': '__docs__'}"]
        for b in py:
            script.append(f"exec(compile({b.code!r}, {f'{rel} (block at line {b.line})'!r}, "
                          "'exec'), ns)")
        p = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, p.stderr[-6000:]
        assert p.stdout.strip()
    commands = []
    for b in blocks:
        if b.lang != "bash":
            continue
        for words in shell_commands(b.code):
            if any(tuple(words[: len(s)]) == s for s in SKIPPED):
                continue
            assert words[0] == "privlearn", f"{page}:{b.line}: unknown command {words!r}"
            commands.append(words[1:])
    if commands:  # in order, in one interpreter, through the console script's entry point
        p = subprocess.run([sys.executable, "-c", SHELL_RUNNER, json.dumps(commands)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, f"{page}: {p.stderr[-6000:]}"


#: Makes :class:`privlearn.errors.PrivacyLeakWarning` an error in a page's interpreter.
NO_LEAK = ("import warnings; from privlearn.errors import PrivacyLeakWarning; "
           "warnings.simplefilter('error', PrivacyLeakWarning)")


#: Runs the ``privlearn`` commands of a page one after the other through
#: ``privlearn.cli.main`` (what the console script and ``python -m privlearn`` call), in
#: one interpreter rather than one per command; stops at the first nonzero exit status.
SHELL_RUNNER = """
import json, sys
from privlearn.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (exit_.code is not None)
    if status:
        sys.exit(f"exit status {status}: privlearn {' '.join(argv)}")
"""


def test_cli_guide_equivalence_is_true() -> None:
    """The guide's worked example: B=512, N=50000, 30 epochs = rate 0.01024, 2940 steps."""
    from privlearn.accounting import Gaussian, compose, subsample

    eps = compose(subsample(Gaussian(1.0), 0.01024), steps=2940).epsilon(1e-5)
    assert round(eps, 4) == 3.2434
    assert "3.2434" in (DOCS / "guides" / "cli.md").read_text()


# ---------------------------------------------------------------------------------------
# the text of the user pages
# ---------------------------------------------------------------------------------------
def _prose(text: str) -> str:
    """The page without its fenced blocks (code, directives), each replaced by blank
    lines so that line numbers stay those of the page."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^(```+|:::+)", line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if line.startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# a page path (docs/x.md, guides/x.md, x.md), or a source file of the package or the tests,
# written out instead of linked
PLAIN_PATH = re.compile(r"(?<![\w/.-])(?:[\w.-]+/)*[\w-]+\.md\b|\b(?:privlearn|tests)/[\w/]+\.py\b")
LINK = re.compile(r"!?\[[^\]]*\]\([^)\s]*\)")  # Markdown links and images
ROLE = re.compile(r"\{[\w:-]+\}`[^`]*`")      # {doc}`...`, {term}`...`, {func}`...`


def _plain_paths(text: str) -> list[tuple[int, str]]:
    prose = _prose(text)
    prose = LINK.sub(lambda m: " " * len(m.group()), prose)
    prose = ROLE.sub(lambda m: " " * len(m.group()), prose)
    return [(_line(prose, m.start()), m.group()) for m in PLAIN_PATH.finditer(prose)]


def test_plain_path_detector() -> None:
    text = ("See docs/budgeting.md and guides/pytorch.md, or `docs/auditing.md`, or\n"
            "privlearn/torch/_allocator.py. [The guide](guides/ledger.md) and\n"
            "{doc}`/guides/cli` are links.\n```bash\npython x.py --out docs/benchmarks.md\n```\n")
    assert [p for _, p in _plain_paths(text)] == [
        "docs/budgeting.md", "guides/pytorch.md", "docs/auditing.md",
        "privlearn/torch/_allocator.py"]


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_cross_references_are_links(page: Path) -> None:
    """A page or source file named in the text must be a link (checked by the build)
    or an API role, never a plain path the reader has to find."""
    found = _plain_paths(page.read_text())
    assert not found, (f"{page.relative_to(ROOT)}: plain paths instead of links "
                       f"(line, path): {found}")


HISTORY = [
    (re.compile(r"\bissues?[ -]?#?\d+", re.I), "an issue number"),
    (re.compile(r"\b20\d\d-\d\d-\d\d(?!\d)"), "a date"),
    (re.compile(r"\bseed 000\b", re.I), "the internal name of a past study"),
    (re.compile(r"\bthe LR study\b", re.I), "the internal name of a past study"),
    (re.compile(r"\bthe trial of\b|\bloaded day\b|\b2-core machine\b", re.I),
     "a dated trial or the development machine"),
    (re.compile(r"\bbeing reorgani[sz]ed\b|\buntil that lands\b|\bwill then show\b", re.I),
     "work in progress"),
]


def test_history_detector() -> None:
    # (an issue number written in two pieces, so that this file holds none)
    bad = "Fixed in issue " + "12 (the trial of 2026-11-26), as seed 000 did in the LR study."
    assert {why for rx, why in HISTORY if rx.search(bad)} == {
        "an issue number", "a date", "the internal name of a past study",
        "a dated trial or the development machine"}
    assert any(rx.search("  1  2026-11-23T20:57:58+00:00  budget") for rx, _ in HISTORY)
    assert not any(rx.search("the noise multiplier of 2000 steps, seed 0; each trial of a "
                             "search") for rx, _ in HISTORY)


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_development_history(page: Path) -> None:
    """User pages describe the library as it is (the benchmarks page keeps its dates)."""
    text = page.read_text()
    found = [(_line(text, m.start()), m.group(), why) for rx, why in HISTORY
             for m in rx.finditer(text)]
    assert not found, f"{page.relative_to(ROOT)}: development history: {found}"


TERMS = {"PLD": re.compile(r"\bPLDs?\b"), "RDP": re.compile(r"\bRDP\b"),
         "dominating pair": re.compile(r"\bdominating pairs?\b", re.I)}
CODE_OR_ROLE = re.compile(r"\{([\w:-]+)\}`[^`]*`|`[^`]+`")


def _first_uses(text: str) -> dict[str, tuple[int, bool]]:
    """For each term: (line of its first use in the prose, whether that use is inside a
    {term} role). Fenced blocks and inline code do not count as uses."""
    prose, linked = _prose(text), []
    for m in CODE_OR_ROLE.finditer(prose):
        if m.group(1) == "term":
            linked.append(m.span())
        elif m.group(1) is None:  # inline code: not a use
            prose = prose[:m.start()] + " " * (m.end() - m.start()) + prose[m.end():]
    out = {}
    for term, rx in TERMS.items():
        m = rx.search(prose)
        if m is not None:
            inside = any(a <= m.start() < b for a, b in linked)
            out[term] = (_line(prose, m.start()), inside)
    return out


def test_first_use_detector() -> None:
    text = ("The `pld` accountant.\n```python\nPLD\n```\nThe {term}`PLD <privacy loss "
            "distribution (PLD)>` is ... RDP is looser; a dominating pair.\n")
    assert _first_uses(text) == {"PLD": (5, True), "RDP": (5, False),
                                 "dominating pair": (5, False)}
    assert _first_uses("{doc}`/x`. A {term}`dominating pair`, `RDP` then RDP.") == {
        "dominating pair": (1, True), "RDP": (1, False)}


@pytest.mark.parametrize("page", [p for p in _doc_pages() if p.name != "glossary.md"],
                         ids=lambda p: str(p.relative_to(DOCS)))
def test_terms_are_explained_on_first_use(page: Path) -> None:
    """PLD, RDP and dominating pair are jargon: where a page first uses one, it links the
    glossary entry ({term} role), so a reader arriving on that page can look it up."""
    bad = {t: line for t, (line, inside) in _first_uses(page.read_text()).items() if not inside}
    assert not bad, (f"{page.relative_to(ROOT)}: first use without a {{term}} link to the "
                     f"glossary (term: line): {bad}")


def test_every_tutorial_block_runs() -> None:
    """A tutorial is a complete run: every code block is Python or a shell command that
    the page runner executes, none is skipped."""
    assert {p.stem for p in TUTORIALS} >= {"accounting", "estimators", "pytorch", "huggingface",
                                           "ledger", "auditing"}
    for page in TUTORIALS:
        blocks = [b for b in readme_blocks(page) if not b.lang.startswith("{")]
        assert blocks, page
        assert all(b.lang in ("python", "bash") for b in blocks), (
            f"{page.name}: blocks the runner does not execute: "
            f"{[(b.line, b.lang) for b in blocks if b.lang not in ('python', 'bash')]}")
        assert len(_runnable(page)) == len(blocks), f"{page.name}: a block is skipped"
        assert page in PAGES


@SITE
def test_api_roles_in_user_pages_resolve(built_site: Path) -> None:
    """Every {func}/{class}/{mod}/... role of a user page is a link to its reference page
    (Sphinx leaves an unresolved Python cross-reference as plain code, without a
    warning)."""
    unresolved = {}
    for html_path in built_site.rglob("*.html"):
        rel = html_path.relative_to(built_site)
        if rel.parts[0] in ("api", "_modules", "_static") or rel.name in ("genindex.html",
                                                                          "search.html"):
            continue
        html = html_path.read_text()
        for m in re.finditer(r'(<a [^>]*>)?<code class="xref py py-(\w+)[^"]*">'
                             r'<span class="pre">([^<]*)</span>', html):
            if not m.group(1):
                unresolved.setdefault(str(rel), []).append(f"{m.group(2)}:{m.group(3)}")
    assert not unresolved, f"API roles that resolve to nothing: {unresolved}"


#: Replaces the OS's entropy (``os.urandom``, and through ``random._urandom`` the
#: ``secrets`` module) in a page's interpreter by a stream derived from ``key``.
FIXED_ENTROPY = """
import hashlib, os, random
_drawn = [0]
def _urandom(n):
    out = b""
    while len(out) < n:
        _drawn[0] += 1
        out += hashlib.sha256(f"{key}/{_drawn[0]}".encode()).digest()
    return out[:n]
os.urandom = random._urandom = _urandom
"""


@pytest.mark.slow
def test_audit_tutorial_verdict_does_not_depend_on_os_entropy(tmp_path: Path) -> None:
    """The audit tutorial asserts the verdict of an audit of a DP run: the run must be
    repeatable (seeded), not a draw from the OS's entropy that fails the page now and
    then. Its first audit, under two different entropy sources, prints the same."""
    pytest.importorskip("torch")
    page = DOCS / "tutorials" / "audit-your-model.md"
    blocks = [b for b in _runnable(page) if b.lang == "python"][:2]
    assert "assert not result.violation" in blocks[1].code
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    outs = []
    for key in ("first", "second"):
        script = [f"key = {key!r}", FIXED_ENTROPY, "ns = {'__name__': '__docs__'}"]
        script += [f"exec(compile({b.code!r}, {str(page)!r}, 'exec'), ns)" for b in blocks]
        p = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(p.stdout)
    assert outs[0] == outs[1] != ""
