"""``benchmarks/torch_hf.py``: the model sizes it claims, the ratios it reports, the
section it writes, and its GPU code path run end to end on the CPU at a tiny size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    import torch_hf  # noqa: E402
finally:
    sys.path.pop(0)


def _lora_params(layers: int, r: int, fan_in: int, fan_out: int) -> int:
    """LoRA adds A (r x fan_in) and B (fan_out x r) to each adapted matrix."""
    return layers * r * (fan_in + fan_out)


def test_tiny_models_have_the_small_structures():
    gpt2, _ = torch_hf.build("gpt2", "tiny")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied
    llama, _ = torch_hf.build("llama", "tiny")
    cfg = llama.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped key/value heads
    lora, _ = torch_hf.build("gpt2-lora", "tiny")
    total, trainable = torch_hf._param_counts(lora)
    d = 32
    assert trainable == _lora_params(2, 16, d, 3 * d)  # c_attn: d -> 3d in each block
    assert torch_hf.workload("gpt2-lora", "tiny").lora_rank == 16


@pytest.mark.slow
def test_small_models_are_the_realistic_sizes():
    """GPT-2 small is the published 124M-parameter model (124,439,808 with tied
    embeddings), BERT-base 110M (109,482,240 for the encoder and pooler; the 2-class
    head adds 768 x 2 + 2), the Llama ~150M with 4 key/value heads for 12 query heads,
    LoRA r16 on GPT-2 small's 12 c_attn (768 -> 2304)."""
    counts = {m: torch_hf._param_counts(torch_hf.build(m, "small")[0])
              for m in torch_hf.ALL_MODELS}
    assert counts["gpt2"] == (124_439_808, 124_439_808)
    assert counts["bert"][0] == 109_482_240 + 768 * 2 + 2
    assert 140e6 < counts["llama"][0] < 160e6
    assert counts["gpt2-lora"] == (124_439_808 + _lora_params(12, 16, 768, 2304),
                                   _lora_params(12, 16, 768, 2304))
    shapes = {m: (w.batch, w.seq) for m in torch_hf.ALL_MODELS
              for w in [torch_hf.workload(m, "small")]}
    assert shapes == {"gpt2": (16, 256), "bert": (32, 128), "llama": (16, 256),
                      "gpt2-lora": (16, 256)}


def _result(mode, ms, mb, model="gpt2", dtype="fp32"):
    return {"model": model, "dtype": dtype, "mode": mode, "steps": 10, "step_s": ms / 1000,
            "mean_batch": 16.0, "peak_added_mb": mb, "held_mb": 500.0, "params": 124_439_808,
            "trainable": 124_439_808}


def test_summary_ratios():
    results = [_result("non-private", 40, 1000), _result("privlearn", 100, 1500),
               _result("opacus-hooks", 250, 9000), _result("opacus-functorch", 200, 9500),
               {"model": "gpt2", "dtype": "fp32", "mode": "opacus-ghost",
                "error": "NotImplementedError: tied"}]
    row = torch_hf.summary({"gpt2 fp32": results}).splitlines()[2]
    assert row == "| gpt2 fp32 | 2.50 | 0.50 | opacus-functorch | 1500 (1000) | 1.50 |"
    lines = torch_hf.table(results).splitlines()
    assert "held MB" in lines[0]  # the CUDA column
    assert {line.count("|") for line in lines} == {10}  # 9 columns in every row
    assert lines[3].startswith("| privlearn | 100 | 2.50 | 1.00 | 1500 | 1.50 | 500 |")
    assert "fails: NotImplementedError: tied" in lines[-1]
    # privlearn 2.5x non-private (target <= 1.3), hooks 2.5x slower (>= 1.3), 1.5x memory
    row = torch_hf.targets({"gpt2 fp32": results}).splitlines()[-1]
    assert row == "| gpt2 fp32 | 2.50 (missed) | 2.50 (met) | 1.50 (missed) |"
    bert = [dict(r, model="bert") for r in results]  # the time targets are GPT-2's
    row = torch_hf.targets({"bert": bert}).splitlines()[-1]
    assert row == "| bert | 2.50 (no target) | 2.50 (no target) | 1.50 (missed) |"


def test_ratio_is_the_median_of_same_round_ratios():
    """Interleaved runs: the median over rounds of the two modes' time ratio in the same
    round (here 2, 4, 3 -> 3, where the ratio of medians is 4 / 1); otherwise, or when the
    rounds do not align, the ratio of the median step times."""
    a = {"step_s": 4.0, "times": [2.0, 4.0, 9.0]}
    b = {"step_s": 1.0, "times": [1.0, 1.0, 3.0]}
    assert torch_hf.ratio(a, b) == 3.0
    assert torch_hf.ratio({"step_s": 4.0}, b) == 4.0
    assert torch_hf.ratio(a, {"step_s": 1.0, "times": [1.0, 1.0]}) == 4.0


def test_interleave_rotates_times_only_the_step_and_drops_a_failing_setup(monkeypatch):
    """A fake clock advanced by each callable: the times are exactly the steps' own (the
    untimed draws and the warm-up rounds excluded), every round runs every live setup
    once, starting one further each round, and a setup that raises is dropped and
    reported while the others run on."""
    clock = [0.0]
    monkeypatch.setattr(torch_hf.time, "perf_counter", lambda: clock[0])
    calls, errors = [], []

    def step(name, cost):
        def run():
            calls.append(name)
            if name == "c" and calls.count("c") == 3:
                raise RuntimeError("boom")
            clock[0] += cost
        return run

    def draw():
        clock[0] += 100.0

    steps = {"a": step("a", 1.0), "b": step("b", 2.0), "c": step("c", 3.0)}
    times = torch_hf.interleave(steps, rounds=4, warmup=1, untimed={"a": draw},
                                on_error=lambda name, exc: errors.append((name, str(exc))))
    assert times == {"a": [1.0] * 4, "b": [2.0] * 4}
    assert errors == [("c", "boom")]
    assert calls[:9] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert calls[9:] == ["a", "b", "b", "a"]  # c gone after its failing third call


@pytest.mark.slow
def test_interleaved_modes_train_on_equal_fixed_size_batches():
    """Every mode, privlearn and Opacus included, steps on batches of exactly B rows."""
    pytest.importorskip("opacus")
    res = torch_hf.measure_interleaved("bert", ["non-private", "privlearn", "opacus-hooks"],
                                       "fp32", rounds=2, warmup=1, size="tiny", batch=6)
    for r in res:
        assert "error" not in r, r
        assert r["steps"] == 2 and r["min_batch"] == 6 and r["mean_batch"] == 6.0
        assert r["peak_added_mb"] > 0


def test_section_replaced_in_place(tmp_path):
    doc = tmp_path / "b.md"
    head = torch_hf._section("cuda", "small")
    doc.write_text(f"# B\n\n## Before\n\ntext\n\n{head}\n\nold figures\n\n## After\n\nkeep\n")
    torch_hf.write_section(doc, f"{head}\n\nnew figures\n", "cuda", "small")
    assert doc.read_text() == ("# B\n\n## Before\n\ntext\n\n" + head + "\n\nnew figures\n"
                               "\n## After\n\nkeep\n")
    assert torch_hf._section("cpu") == torch_hf.SECTION  # the CPU figures keep their place
    assert torch_hf._section("cpu", "mini", 16) == torch_hf.SECTION[:-1] + ", batch 16)"


def test_time_budget_reports_every_configuration_as_not_run(tmp_path):
    out = tmp_path / "b.md"
    res = torch_hf.main(["--size", "tiny", "--models", "gpt2,llama", "--dtype", "fp32,bf16",
                         "--budget-seconds", "0", "--out", str(out), "--json",
                         str(tmp_path / "r.json")])
    assert set(res) == {(m, d) for m in ("gpt2", "llama") for d in ("fp32", "bf16")}
    assert all("not run" in r["error"] for rs in res.values() for r in rs)
    text = out.read_text()
    assert text.startswith("## Hugging Face transformers (DP-SGD step time and memory, tiny "
                           "models, CPU)")
    assert text.count("fails: not run: time budget spent") == 4 * 6


def test_bad_arguments_name_the_option():
    with pytest.raises(SystemExit, match="--dtype entries must be in"):
        torch_hf.parse_args(["--dtype", "fp16"])
    with pytest.raises(SystemExit, match="--models entries must be in"):
        torch_hf.parse_args(["--models", "gpt3"])


@pytest.mark.slow
@pytest.mark.parametrize("processes", ["interleaved", "one", "per-config"])
def test_tiny_grid_runs_end_to_end(tmp_path, processes, monkeypatch):
    """The whole grid at the tiny size, fp32 and bf16 autocast, in both process layouts
    (``one`` is the layout used on CUDA): every model trains without and with privlearn,
    and the section holds a table per model and precision."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned process imports torch_hf
    out = tmp_path / "b.md"
    res = torch_hf.main(["--size", "tiny", "--dtype", "fp32,bf16", "--steps", "2",
                         "--warmup", "1", "--rounds", "2", "--processes", processes,
                         "--out", str(out), "--json", str(tmp_path / "r.json")])
    for (model, dtype), results in res.items():
        by = {r["mode"]: r for r in results}
        for mode in ("non-private", "privlearn"):
            assert "error" not in by[mode], (model, dtype, mode, by[mode])
            assert by[mode]["step_s"] > 0 and by[mode]["rounds"] == 2
    text = out.read_text()
    assert text.count("\n### ") == 8 and "bf16 autocast" in text
