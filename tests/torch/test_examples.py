"""The text example runs offline (config-initialised GPT-2 + LoRA through DPTrainer) and
reports the accountant's epsilon for the steps it took."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dp_lora_text.py"


def test_dp_lora_text_example_offline():
    from privlearn.accounting import Gaussian, compose, subsample

    spec = importlib.util.spec_from_file_location("dp_lora_text", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    try:
        res = mod.main(["--offline", "--steps", "3", "--batch", "8", "--block", "16",
                        "--epsilon", "4"])
    finally:
        torch.set_num_threads(threads)
    assert res["steps"] == 3
    eps = compose(subsample(Gaussian(res["noise_multiplier"]), rate=res["sampling_rate"]),
                  steps=3).epsilon(1e-5)
    assert res["epsilon"] == pytest.approx(eps, rel=1e-9) and res["epsilon"] <= 4.0 + 1e-9
    assert math.isfinite(res["heldout_loss_after"])


def test_dp_lora_text_offline_model_has_its_special_tokens_in_the_byte_vocabulary():
    """The offline model reads bytes (a vocabulary of 256): GPT-2's default special tokens
    (50256) would lie outside it, which transformers reports on every run."""
    spec = importlib.util.spec_from_file_location("dp_lora_text", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, encode, _ = mod.load_model("gpt2", offline=True, block=16)
    cfg = model.config
    assert max(encode("any text")) < cfg.vocab_size == 256
    assert 0 <= cfg.bos_token_id < cfg.vocab_size and 0 <= cfg.eos_token_id < cfg.vocab_size
