"""examples/mnist_dpsgd.py without the MNIST files: one line that says which of the
script's own options supply them, not a traceback naming a Python argument."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_dpsgd.py"


def test_mnist_example_without_the_data_names_its_options(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRIVLEARN_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = importlib.util.spec_from_file_location("mnist_dpsgd", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--quick", "--threads", "1", "--data-home", str(tmp_path / "empty")])
    message = str(exit_.value.code)
    assert message.startswith("error: MNIST files not found")
    assert "--data-home DIR or --download" in message
