"""Accounting demo: the privacy of four DP learning algorithms, recomputed with privlearn.

A tutorial on accounting for DP learning algorithms with autodp (NoisyGD, NoisySGD, PATE,
Private kNN and their Laplace variants) prints one epsilon per algorithm at delta = 1e-6.
:func:`accounting_table` recomputes each with privlearn's accountants -- the PLD upper and
lower bounds and the RDP bound -- next to the value autodp prints, and
:func:`print_accounting_table` prints it (see :doc:`/reference/provenance`). ``privlearn demo``
runs :func:`main`, which also runs a short experiment when
``privlearn.experiments.demo_linear_regression`` exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from privlearn.accounting import (
    Gaussian,
    Laplace,
    Mechanism,
    UnsupportedMechanismError,
    compose,
    subsample,
)

__all__ = [
    "AccountingRow",
    "SCENARIOS",
    "DELTA",
    "accounting_table",
    "print_accounting_table",
    "main",
]

DELTA = 1e-6
"""The delta of every row of the accounting table."""


@dataclass(frozen=True)
class Scenario:
    """One algorithm of the table: its name, its mechanism and the epsilon autodp prints."""

    name: str
    parameters: str
    mechanism: Mechanism
    seed_epsilon: float


@dataclass(frozen=True)
class AccountingRow:
    """One row of the accounting table (all epsilons at :data:`DELTA`).

    Attributes
    ----------
    scenario : str
        The algorithm.
    parameters : str
        Its privacy parameters.
    seed_epsilon : float
        The value autodp prints in the accounting tutorial (analytic Gaussian for the
        Gaussian rows, RDP otherwise).
    pld_upper, pld_lower : float or None
        privlearn's PLD accountant: certified upper and lower bounds (None if the PLD
        accountant does not support the mechanism).
    rdp : float or None
        privlearn's RDP accountant (certified upper bound).
    """

    scenario: str
    parameters: str
    seed_epsilon: float
    pld_upper: float | None
    pld_lower: float | None
    rdp: float | None


def _scenarios() -> tuple[Scenario, ...]:
    noisy_sgd = compose(subsample(Gaussian(5.0), 0.01), steps=1000)
    laplace_sgd = compose(subsample(Laplace(5.0), 0.01), steps=1000)
    return (
        Scenario(
            "NoisyGD",
            "sigma_list=[5, 3, 4]",
            compose([Gaussian(5.0), Gaussian(3.0), Gaussian(4.0)]),
            2.0677358464697515,
        ),
        Scenario("NoisySGD", "q=0.01, sigma=5, T=1000 (Poisson)", noisy_sgd, 0.27105623043762284),
        Scenario(
            "PATE (Gaussian)",
            "sigma=5, m=100",
            compose(Gaussian(5.0), steps=100),
            10.99715121422065,
        ),
        Scenario(
            "Private kNN", "q=0.01, sigma=5, m=1000 (Poisson)", noisy_sgd, 0.27105623043762284
        ),
        Scenario(
            "PATE / NoisyGD (Laplace)",
            "b=5, m=100",
            compose(Laplace(5.0), steps=100),
            10.850346958780321,
        ),
        Scenario(
            "NoisySGD / Private kNN (Laplace)",
            "q=0.01, b=5, m=1000 (Poisson)",
            laplace_sgd,
            0.2569326333160541,
        ),
    )


SCENARIOS: tuple[Scenario, ...] = _scenarios()
"""The tutorial's algorithms, as privlearn mechanisms, with the epsilons autodp prints."""


def accounting_table(delta: float = DELTA) -> list[AccountingRow]:
    """Recompute the accounting table with privlearn (one row per :data:`SCENARIOS` entry).

    A mechanism that an accountant does not support gets ``None`` in that column; any
    other failure raises. Repeated mechanisms are evaluated once.
    """
    cache: dict[tuple[Mechanism, str], tuple[float | None, float | None]] = {}

    def bounds(m: Mechanism, accountant: str) -> tuple[float | None, float | None]:
        key = (m, accountant)
        if key not in cache:
            try:
                b = m.epsilon_bounds(delta, accountant)
                cache[key] = (b.upper, b.lower)
            except UnsupportedMechanismError:
                cache[key] = (None, None)
        return cache[key]

    rows = []
    for s in SCENARIOS:
        pld_upper, pld_lower = bounds(s.mechanism, "pld")
        rdp, _ = bounds(s.mechanism, "rdp")
        rows.append(AccountingRow(s.name, s.parameters, s.seed_epsilon, pld_upper, pld_lower, rdp))
    return rows


def _fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    if math.isinf(x):
        return "inf"
    return f"{x:.6g}"


def print_accounting_table(
    rows: list[AccountingRow] | None = None, echo: Callable[[str], object] = print
) -> None:
    """Print :func:`accounting_table` as a fixed-width text table."""
    if rows is None:
        rows = accounting_table()
    header = ("algorithm", "parameters", "autodp", "PLD upper", "PLD lower", "RDP")
    body = [
        (
            r.scenario,
            r.parameters,
            _fmt(r.seed_epsilon),
            _fmt(r.pld_upper),
            _fmt(r.pld_lower),
            _fmt(r.rdp),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        left = [c.ljust(w) for c, w in zip(cells[:2], widths[:2], strict=True)]
        right = [c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(left + right)

    echo(f"Privacy accounting of DP learning algorithms: epsilon at delta = {DELTA:g}")
    echo("(privlearn's certified upper bounds, PLD lower bounds, and the value the autodp "
         "tutorial prints)")
    echo(line(header))
    echo("  ".join("-" * w for w in widths))
    for cells in body:
        echo(line(cells))


def main(experiment: bool = True, echo: Callable[[str], object] = print) -> None:
    """Print the accounting table, then run the short experiment demo if available.

    Parameters
    ----------
    experiment : bool
        Run ``privlearn.experiments.demo_linear_regression()`` after the table, when that
        function exists (it is skipped silently otherwise).
    """
    print_accounting_table(echo=echo)
    if not experiment:
        return
    import privlearn.experiments as experiments  # an ImportError here is a real error

    demo_linear_regression = getattr(experiments, "demo_linear_regression", None)
    if demo_linear_regression is None:
        return
    echo("")
    demo_linear_regression()
