"""Shared helpers for the experiments: output paths, CSV, progress bars, plotting."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from privlearn import _progress
from privlearn.errors import ParameterValueError

__all__ = [
    "ExperimentResult",
    "write_csv",
    "progress",
    "prepare_out_dir",
    "format_table",
    "pyplot",
    "epsilon_log_axis",
    "median_errorbar",
    "accuracy_spread",
    "save_figure",
    "DEFAULT_OUT_DIR",
]

#: Where experiments write when no output directory is given (relative to the current
#: working directory).
DEFAULT_OUT_DIR = "privlearn-output"


@dataclass
class ExperimentResult:
    """What an experiment produced: the files written and the rows of its table."""

    name: str
    csv_path: Path | None
    png_path: Path | None
    rows: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    extra_paths: list[Path] = field(default_factory=list)

    @property
    def paths(self) -> list[Path]:
        return [p for p in (self.csv_path, self.png_path, *self.extra_paths) if p is not None]


def prepare_out_dir(out_dir) -> Path:
    """Create and return ``out_dir`` (default :data:`DEFAULT_OUT_DIR`, ``./privlearn-output``)."""
    path = Path(out_dir if out_dir is not None else DEFAULT_OUT_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    if not rows:
        raise ParameterValueError("no rows to write")
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend, imported on first use
    (so commands that draw nothing never import matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def epsilon_log_axis(ax, epsilons) -> None:
    """A log-scale epsilon axis labelled only at the grid's own values, in plain numbers
    (no overlapping ``3 x 10^0``-style minor labels)."""
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(sorted(float(e) for e in epsilons)))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def accuracy_spread(accuracies) -> dict[str, float]:
    """The median, minimum and maximum of the repetitions' ``accuracies``, as the
    ``median_accuracy``, ``min_accuracy`` and ``max_accuracy`` columns of a table row."""
    import numpy as np

    a = np.asarray(accuracies, dtype=float)
    return {"median_accuracy": float(np.median(a)), "min_accuracy": float(a.min()),
            "max_accuracy": float(a.max())}


def median_errorbar(ax, x, values, **kwargs):
    """Plot the median of each row of ``values`` against ``x``, with error bars from the
    row's minimum to its maximum (the repetitions' spread); ``kwargs`` go to
    ``ax.errorbar``."""
    import numpy as np

    med = np.median(values, axis=1)
    return ax.errorbar(x, med, yerr=[med - values.min(1), values.max(1) - med], **kwargs)


def save_figure(fig, path: Path, *, tight: bool = True) -> Path:
    """Write ``fig`` to ``path`` at 100 dpi (cropped to its content with ``tight``) and
    close it; returns ``path``."""
    fig.savefig(path, dpi=100, **({"bbox_inches": "tight"} if tight else {}))
    pyplot().close(fig)
    return path


def progress(iterable=None, *, total=None, desc: str = "", enabled: bool | None = None):
    """A tqdm progress bar on standard error, shown only on a terminal (or when
    ``enabled`` is True): :func:`privlearn._progress.progress`."""
    return _progress.progress(iterable, total=total, desc=desc,
                              enabled=None if enabled is None else bool(enabled))


def format_table(rows: list[dict], columns: list[str], floatfmt: str = ".4f") -> str:
    def fmt(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)
