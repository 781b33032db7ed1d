"""Private LoRA fine-tuning of a causal language model with the Hugging Face Trainer.

A GPT-2-style model gets LoRA adapters (peft) on its attention projections and is
fine-tuned with DP-SGD through :class:`privlearn.torch.hf.DPTrainer`: Poisson sampling,
per-example clipping of the adapter gradients, Gaussian noise calibrated so that the
planned run is ``(--epsilon, 1e-5)``-DP, and the epsilon actually spent in every log line.
Only the adapters (about 1% of GPT-2's parameters) are trained and released.

Model: ``--model gpt2`` (or any causal LM id or local path) is loaded with
``from_pretrained`` where its weights are available (downloaded or in the local Hugging
Face cache). With ``--offline``, or when loading fails, a small GPT-2 config is initialised
at random instead and the text is tokenised as bytes (no tokenizer files needed) -- the
run then shows the mechanics and the privacy accounting, not the quality of fine-tuning a
pretrained model.

Data: Python's own reference documentation as shipped with every Python installation
(``pydoc_data.topics``, about 460 kB of English technical prose), cut into blocks of
``--block`` tokens; 256 blocks (at most 10%) held out, the rest trained on. It is real
text, but public: it stands in for a private corpus here.

Usage::

    python examples/dp_lora_text.py --offline            # ~1 min on CPU
    python examples/dp_lora_text.py --model gpt2 --steps 300 --epsilon 3

The held-out loss (per token, nats) is printed before and after training.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch

try:
    import peft
    import transformers
except ImportError as exc:  # pragma: no cover
    raise SystemExit(f"this example needs the hf extra: pip install 'privlearn[hf]' "
                     f"({exc})") from None

from privlearn.torch import per_sequence_cross_entropy
from privlearn.torch.hf import DPTrainer, PrivacyArguments


def corpus() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


class Blocks(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        x = self.ids[i]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}


def load_model(name: str, offline: bool, block: int):
    """(model, encode function, description)."""
    if not offline:
        try:
            tok = transformers.AutoTokenizer.from_pretrained(name)
            model = transformers.AutoModelForCausalLM.from_pretrained(name)
            return model, lambda s: tok(s)["input_ids"], f"pretrained {name}"
        except (OSError, ValueError) as exc:
            print(f"could not load {name!r} ({type(exc).__name__}); using a config-"
                  "initialised model (pass --offline to skip the attempt)")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=block, n_embd=64, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)  # inside the byte vocabulary
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    return model, lambda s: list(s.encode("utf-8")), "config-initialised GPT-2 (bytes)"


@torch.no_grad()
def heldout_loss(model, data: Blocks, batch: int = 64) -> float:
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(data), batch):
        ids = data.ids[i:i + batch]
        logits = model(input_ids=ids).logits
        total += per_sequence_cross_entropy(logits, ids, shift=True, reduction="sum").item()
        n += ids.shape[0]
    model.train(was)
    return total / n


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--offline", action="store_true",
                    help="do not try from_pretrained; use a config-initialised model")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64, help="expected (Poisson) batch size")
    ap.add_argument("--block", type=int, default=64, help="tokens per example")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--lora-targets", default=None,
                    help="comma-separated module names for LoRA (default: peft's choice "
                         "for the model type, c_attn for GPT-2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, encode, what = load_model(args.model, args.offline, args.block)
    ids = torch.tensor(encode(corpus()), dtype=torch.long)
    n_blocks = ids.numel() // args.block
    blocks = ids[: n_blocks * args.block].view(n_blocks, args.block)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(n_blocks, generator=g)
    n_test = min(n_blocks // 10, 256)
    test, train = Blocks(blocks[perm[:n_test]]), Blocks(blocks[perm[n_test:]])

    targets = args.lora_targets.split(",") if args.lora_targets else None
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=targets, lora_dropout=0.0,
        fan_in_fan_out=model.config.model_type == "gpt2",  # GPT-2's Conv1D layout
        task_type="CAUSAL_LM"))
    model.print_trainable_parameters()
    before = heldout_loss(model, test)

    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps,
            learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=10,
            save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True, dataloader_pin_memory=False)
        trainer = DPTrainer(
            model=model, args=targs, train_dataset=train,
            data_collator=transformers.default_data_collator,
            privacy=PrivacyArguments(target_epsilon=args.epsilon, target_delta=1e-5,
                                     max_grad_norm=args.max_grad_norm, seed=args.seed,
                                     task="causal_lm"))
        t0 = time.perf_counter()
        trainer.train()
        secs = time.perf_counter() - t0
    p = trainer.privacy_engine
    after = heldout_loss(model, test)
    res = {"model": what, "train_examples": len(train), "heldout_examples": len(test),
           "steps": p.accountant.steps, "sampling_rate": p.sampling_rate,
           "noise_multiplier": p.noise_multiplier, "epsilon": trainer.epsilon(),
           "delta": 1e-5, "heldout_loss_before": before, "heldout_loss_after": after,
           "train_seconds": secs}
    print(f"{what}: {res['steps']} steps, q = {p.sampling_rate:.4f}, sigma = "
          f"{p.noise_multiplier:.3f} -> epsilon = {res['epsilon']:.3f} at delta = 1e-5")
    print(f"held-out loss per token: {before:.3f} -> {after:.3f} nats "
          f"(perplexity {math.exp(before):.1f} -> {math.exp(after):.1f}); "
          f"training {secs:.1f} s")
    return res


if __name__ == "__main__":
    main()
