"""DP-SGD on MNIST with the small CNN of Tramer & Boneh (2021), using privlearn.torch.

Reproduces the end-to-end CNN of F. Tramer and D. Boneh, "Differentially Private Learning
Needs Better Features (or Much More Data)", ICLR 2021 (98.1% test accuracy at
epsilon = 2.93, delta = 1e-5): batch 512, SGD with momentum 0.9, learning rate 0.5,
``max_grad_norm=0.1``, 40 epochs. Here the noise multiplier is calibrated by privlearn so
that the planned run is (target_epsilon, 1e-5)-DP, with Poisson sampling at rate 512/60000
and the accountant of ``--accountant`` (PLD by default, tighter than the RDP accountant the
paper used, so the same budget buys less noise).

Usage::

    python examples/mnist_dpsgd.py                        # full run (CPU: ~30-60 min)
    python examples/mnist_dpsgd.py --quick                # 1 epoch on 10k examples
    python examples/mnist_dpsgd.py --epochs 40 --out /tmp/mnist.json

Data: ``privlearn.datasets.load_mnist``: the four MNIST ``.gz`` files in ``--data-home DIR``,
else ``$PRIVLEARN_DATA/mnist``, else the user cache ``~/.cache/privlearn/mnist``;
``--download`` fetches them there (checksums verified) when they are not found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from privlearn.datasets import load_mnist
from privlearn.errors import DataNotFoundError
from privlearn.torch import make_private
from privlearn.torch.models import mnist_cnn

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def to_tensors(bunch) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (n, 28, 28) images -> normalised float (n, 1, 28, 28); int64 labels."""
    x = (np.asarray(bunch.data, dtype=np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD
    return torch.from_numpy(x).unsqueeze(1), torch.as_tensor(bunch.target, dtype=torch.int64)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2000) -> float:
    """Test accuracy of ``model``, evaluated under ``torch.no_grad`` (the engine's hooks
    record nothing then). The private model stays in training mode: the CNN has no
    dropout or batch-norm, so its training and evaluation forwards are identical."""
    correct = 0
    for i in range(0, len(y), batch):
        correct += (model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum().item()
    return correct / len(y)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=512,
        help="expected (Poisson) batch size; sampling rate = B / 60000",
    )
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--max-grad-norm", type=float, default=0.1)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument(
        "--noise-multiplier",
        type=float,
        default=None,
        help="use this sigma instead of calibrating to --target-epsilon",
    )
    parser.add_argument("--accountant", default="pld", help="privlearn accountant name")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data-home",
        default=None,
        help="directory holding the four MNIST .gz files (default: $PRIVLEARN_DATA/mnist, "
        "then ~/.cache/privlearn/mnist)",
    )
    parser.add_argument(
        "--download",
        action="store_true",
        help="download the MNIST files (checksums verified) when they are not found",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 1 epoch on the first 10,000 training images",
    )
    parser.add_argument("--out", type=Path, default=None, help="write final metrics as JSON")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        x_train, y_train = to_tensors(
            load_mnist("train", data_home=args.data_home, download=args.download))
        x_test, y_test = to_tensors(
            load_mnist("test", data_home=args.data_home, download=args.download))
    except DataNotFoundError as err:
        sys.exit(f"error: {err}. With this script: --data-home DIR or --download")
    if args.quick:
        args.epochs = 1
        x_train, y_train = x_train[:10_000], y_train[:10_000]

    model = mnist_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_train, y_train), batch_size=args.batch_size
    )
    privacy = dict(noise_multiplier=args.noise_multiplier)
    if args.noise_multiplier is None:
        privacy = dict(target_epsilon=args.target_epsilon, epochs=args.epochs)
    p = make_private(
        model,
        optimizer,
        loader,
        target_delta=args.delta,
        max_grad_norm=args.max_grad_norm,
        accountant=args.accountant,
        seed=args.seed,
        **privacy,
    )
    print(
        f"n={len(y_train)} sampling_rate={p.sampling_rate:.5f} "
        f"steps/epoch={len(p.data_loader)} noise_multiplier={p.noise_multiplier:.4f} "
        f"max_grad_norm={args.max_grad_norm} lr={args.lr} momentum={args.momentum} "
        f"accountant={args.accountant}",
        flush=True,
    )

    loss_fn = nn.CrossEntropyLoss()
    history = []
    t_start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        total_loss, seen = 0.0, 0
        for x, y in p.data_loader:
            p.optimizer.zero_grad()
            loss = loss_fn(p.model(x), y)
            loss.backward()
            p.optimizer.step()
            total_loss += loss.item() * len(y)
            seen += len(y)
        train_time = time.perf_counter() - t0
        acc = accuracy(p.model, x_test, y_test)
        eps = p.accountant.epsilon(args.delta)
        history.append(
            dict(
                epoch=epoch,
                train_loss=total_loss / max(seen, 1),
                test_accuracy=acc,
                epsilon=eps,
                epoch_seconds=train_time,
            )
        )
        print(
            f"epoch {epoch:3d}  loss {total_loss / max(seen, 1):.4f}  test acc {acc:.4f}  "
            f"eps {eps:.3f} (delta={args.delta:g})  {train_time:.1f}s",
            flush=True,
        )

    result = dict(
        command=" ".join(["python", "examples/mnist_dpsgd.py", *(argv or sys.argv[1:])]),
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        max_grad_norm=args.max_grad_norm,
        noise_multiplier=p.noise_multiplier,
        target_epsilon=None if args.noise_multiplier is not None else args.target_epsilon,
        sampling_rate=p.sampling_rate,
        accountant=args.accountant,
        delta=args.delta,
        epsilon=history[-1]["epsilon"],
        test_accuracy=history[-1]["test_accuracy"],
        total_seconds=time.perf_counter() - t_start,
        threads=args.threads,
        quick=args.quick,
        history=history,
    )
    print(
        f"final: test accuracy {result['test_accuracy']:.4f} at epsilon "
        f"{result['epsilon']:.3f}, delta {args.delta:g} after {args.epochs} epochs "
        f"({result['total_seconds']:.0f} s)"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
