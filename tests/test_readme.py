"""Every Python and shell block of README.md runs as written.

Python blocks run one by one, each in a fresh namespace, in a temporary working directory.
Shell blocks are split into commands (``\\`` continuations joined, ``&&`` chains split,
``#`` comments dropped); each ``privlearn ...`` command runs through the CLI
(``python -m privlearn ...``, the same entry point as the console script) and must exit 0.
Two kinds of command are skipped, explicitly: ``pip install ...`` (installing is not
tested here) and ``python -m pytest`` (this is the test suite itself). Any other command
fails the test, so a new kind of command in the README has to be taught here.

A block preceded by ``<!-- readme-test: slow -->`` (the full experiments) runs only in the
slow suite (``pytest -m slow``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIPPED_PREFIXES = (("pip", "install"), ("python", "-m", "pytest"))


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    slow: bool


def readme_blocks(path: Path = README) -> list[Block]:
    """Fenced code blocks of a Markdown file (language, text, first line, slow mark)."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)", lines[i])  # any fence: ```python, ```{toctree}, ```
        if m:
            start = i
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            blocks.append(Block(m.group(1), "\n".join(lines[i + 1 : j]) + "\n", start + 1,
                                "readme-test: slow" in prev))
            i = j
        i += 1
    return blocks


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block, as argument lists."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words:
                commands.append(words)
    return commands


BLOCKS = [b for b in readme_blocks() if b.lang in ("python", "bash", "sh", "shell", "console")]


def _param(b: Block):
    marks = [pytest.mark.slow] if b.slow else []
    return pytest.param(b, id=f"{b.lang}-line{b.line}", marks=marks)


def test_readme_has_the_blocks_we_expect() -> None:
    langs = [b.lang for b in readme_blocks()]
    assert langs.count("python") >= 3 and langs.count("bash") >= 4
    # the first two blocks: install + demo, install + tests (what .ci/run runs)
    first, second = BLOCKS[0], BLOCKS[1]
    assert shell_commands(first.code) == [["pip", "install", "."], ["privlearn", "demo"]]
    ci = (ROOT / ".ci" / "run").read_text()
    assert second.code.strip() in ci, "README's test command must be the one .ci/run runs"


def test_shell_parser() -> None:
    code = "privlearn epsilon --a 1 \\\n    --b 2  # comment\npip install x && privlearn demo\n"
    assert shell_commands(code) == [["privlearn", "epsilon", "--a", "1", "--b", "2"],
                                    ["pip", "install", "x"], ["privlearn", "demo"]]


def _have_mnist() -> bool:
    from privlearn.datasets import load_mnist

    try:
        load_mnist("test")
    except FileNotFoundError:
        return False
    return True


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.lang != "python"])
def test_readme_shell_block(block: Block, tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ran = 0
    for words in shell_commands(block.code):
        if any(tuple(words[: len(p)]) == p for p in SKIPPED_PREFIXES):
            continue
        assert words[0] == "privlearn", (
            f"README.md line {block.line}: unknown command {words!r}; teach tests/test_readme.py")
        if words[1:3] == ["reproduce", "label-release"] and not _have_mnist():
            continue  # needs the MNIST files (the command says so); not bundled
        p = subprocess.run([sys.executable, "-m", "privlearn", *words[1:]], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, f"README.md line {block.line}: {words}\n{p.stderr}"
        assert p.stdout.strip(), words
        ran += 1
    skipped_only = all(any(tuple(w[: len(p)]) == p for p in SKIPPED_PREFIXES)
                       for w in shell_commands(block.code))
    assert ran > 0 or skipped_only


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.lang == "python"])
def test_readme_python_block(block: Block, tmp_path, monkeypatch, capsys) -> None:
    if "import torch" in block.code:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    code = compile(block.code, f"README.md (block at line {block.line})", "exec")
    exec(code, {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()  # every block shows a result
