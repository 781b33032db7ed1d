"""Worker functions for the multi-process ledger tests (importable by spawned children)."""

from __future__ import annotations

import sys

from privlearn.accounting import Gaussian
from privlearn.errors import BudgetExceededError
from privlearn.ledger import Ledger


def _each_try(ledger: Ledger, worker: int, n: int, attempt) -> tuple[list[str], list[str]]:
    """Call ``attempt(label)`` for ``n`` labels of ``worker``, then close ``ledger``; the
    labels acknowledged and those refused (BudgetExceededError)."""
    ok, refused = [], []
    for i in range(n):
        label = f"w{worker}-{i}"
        try:
            attempt(label)
        except BudgetExceededError:
            refused.append(label)
        else:
            ok.append(label)
    ledger.close()
    return ok, refused


def spend_many(path: str, worker: int, n: int, sigma: float) -> tuple[list[str], list[str]]:
    """Try ``n`` spends; return the labels acknowledged and those refused."""
    ledger = Ledger(path)

    def spend(label: str) -> None:
        ledger.spend("data", Gaussian(sigma), label=label, who=f"worker{worker}")

    return _each_try(ledger, worker, n, spend)


def create_and_reserve(path: str, worker: int, n: int, sigma: float, start: float
                       ) -> tuple[list[str], list[str]]:
    """From ``start`` (a wall-clock time, so that processes race): create the ledger and
    its budget (``exist_ok``), as a script run on two machines of a cluster at once would,
    then try ``n`` reservations, each settled at its plan; the labels acknowledged and
    those refused."""
    import time

    while time.time() < start:
        pass
    ledger = Ledger(path, create=True)
    ledger.create_budget("data", 1.0, 1e-6, exist_ok=True)

    def reserve(label: str) -> None:
        with ledger.reserve("data", Gaussian(sigma), label=label):
            pass

    return _each_try(ledger, worker, n, reserve)


if __name__ == "__main__":  # crash test: spend forever, acknowledging each spend
    path = sys.argv[1]
    ledger = Ledger(path)
    r = ledger.reserve("data", Gaussian(50.0), label="planned run")
    print(f"RESERVED {r.seq}", flush=True)
    i = 0
    while True:
        e = ledger.spend("data", Gaussian(1000.0), label=f"s{i}")
        print(f"ACK s{i} {e.seq}", flush=True)
        i += 1
