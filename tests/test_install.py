"""``pip install -e ".[torch]"`` keeps a PyTorch the user already has, when it is in the
supported range (a GPU build included), and replaces one outside it.

pip's own resolver decides, offline: a dry run (``--dry-run --no-index``, no package
index, no configuration) of this checkout's ``[torch]`` extra, in an environment where a
stand-in ``torch`` distribution (metadata only, placed first on the path, so it hides any
torch really installed) has the version under test. The plan pip reports must leave torch
alone for a version in the range; for one below it pip must want another torch, which it
cannot find without an index, so it fails naming torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (not find_spec("pip"): under setuptools' distutils hack, looking pip up in this process
# switches the hack off for the rest of the session, and torch.compile then fails)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                                reason="needs setuptools (the build backend) installed")


def _torch_range() -> str:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (req,) = meta["project"]["optional-dependencies"]["torch"]
    m = re.fullmatch(r"torch\s*(?P<spec>[^;]+)", req)
    assert m, req
    return m["spec"].replace(" ", "")


def _lower_bound() -> tuple[int, int]:
    m = re.search(r">=\s*(\d+)\.(\d+)", _torch_range())
    assert m, _torch_range()
    return int(m[1]), int(m[2])


def _pip_plan(torch_version: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess,
                                                           dict | None]:
    """``pip install --dry-run -e ROOT[torch]`` with ``torch_version`` installed: the
    finished process and pip's installation report (None if pip failed)."""
    site = tmp_path / "site"
    dist = site / f"torch-{torch_version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    (dist / "INSTALLER").write_text("pip\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1",
               PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]))
    report = tmp_path / "report.json"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--no-build-isolation", "--quiet", "--report", str(report), "-e", f"{ROOT}[torch]"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    if "No module named pip" in p.stderr:
        pytest.skip("pip is not installed in this environment")
    return p, (json.loads(report.read_text()) if p.returncode == 0 else None)


def test_an_installed_torch_in_the_range_is_kept(tmp_path):
    major, minor = _lower_bound()
    p, report = _pip_plan(f"{major}.{minor}.0+cu128", tmp_path)  # oldest supported, GPU
    assert p.returncode == 0, p.stderr
    planned = {i["metadata"]["name"].lower(): i for i in report["install"]}
    assert set(planned) == {"privlearn"}, sorted(planned)  # torch is not touched
    # the metadata pip built from pyproject.toml names a range for the extra, not a pin
    (req,) = [r for r in planned["privlearn"]["metadata"]["requires_dist"]
              if re.match(r"torch\b", r)]
    assert 'extra == "torch"' in req and "==" not in req.split(";")[0]
    assert "<" in req and ">=" in req, req


def test_a_torch_below_the_range_is_not_accepted(tmp_path):
    """The control: the stand-in torch is what pip sees (it is not the real one)."""
    major, minor = _lower_bound()
    below = f"{major}.{minor - 1}" if minor else f"{major - 1}.99"
    p, _ = _pip_plan(f"{below}.0+cu126", tmp_path)
    assert p.returncode != 0
    assert "torch" in p.stderr and "No matching distribution" in p.stderr, p.stderr
