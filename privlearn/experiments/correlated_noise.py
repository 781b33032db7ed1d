"""DP-SGD vs correlated noise (banded matrix factorization, BLT) on MNIST: test accuracy
vs epsilon, each strategy with its learning rate tuned on a validation split.

Setting (:data:`FULL`; 120 training runs, 14 minutes on two shared CPU cores):

* Data: the 60,000 MNIST training images, split at random into 10,000 validation images
  (for tuning) and 50,000 private training images; the 10,000 test images measure the
  accuracy reported. Pixels scaled to [0, 1], no data-dependent normalisation.
* Model: a 784-128-10 ReLU MLP, plain SGD (constant learning rate, no momentum: the
  prefix-sum workload the correlated strategies are optimised for), clipping bound 1,
  expected batch 250, 10 epochs (2,000 steps), through
  :func:`privlearn.torch.make_private` with ``target_epsilon`` at delta = 1e-5.
* Strategies (:data:`STRATEGIES`):

  - DP-SGD: independent noise, Poisson sampling (``noise="dpsgd", sampling="poisson"``);
  - banded: a ``b``-banded Toeplitz strategy with cyclic Poisson sampling of cycle ``b``
    (``noise="banded", bands=b, sampling="cyclic_poisson", cycle_length=b``), amplified
    (Choquette-Choo et al. 2023b, Theorem 4); ``b`` is chosen at each epsilon among
    :attr:`StudyConfig.bands` as the one with the smallest noise in the iterates at the
    calibrated noise multiplier (a data-independent choice, as in the paper);
  - BLT: a buffered linear Toeplitz strategy (4 buffers) with balls-in-bins sampling
    (``noise="blt", sampling="balls_in_bins"``), certified without amplification.

* Tuning: for each strategy and epsilon, one training run per learning rate of
  :attr:`StudyConfig.learning_rates` (one seed), scored on the validation split; the
  best is then trained with ``reps`` seeds (default 3) and scored on the test set. The
  tuning reads the private data and is **not** accounted: the reported epsilon is that
  of one training run, as in the papers compared (a full accounting would add the cost
  of the selection, e.g. Papernot & Steinke 2022). Its cost (runs and seconds) is in
  the output.
* Theory next to the measurements: for each plan, the root mean squared noise of the
  iterates at learning rate 1, ``sigma C / B * sqrt(mean_t ||(A C^{-1})[t, :]||^2)``
  (prefix-sum workload ``A``, :func:`privlearn.correlated.per_query_error`), and its
  ratio to DP-SGD's.

Outputs: ``correlated_noise.csv`` (one row per strategy and epsilon),
``correlated_noise_runs.csv`` (every training run), ``correlated_noise.md`` (the tables)
and ``correlated_noise.png`` (accuracy vs epsilon, median and min-max of the seeds; the
theoretical noise ratio beside it). ``quick=True`` runs :data:`QUICK`, a small
configuration that finishes in seconds (a smoke test, not a result).

Language-model row (``task="adult-bert"``, :data:`FULL_ADULT_BERT`; ``privlearn
reproduce correlated-noise-adult-bert``): the same strategies, band selection, tuning and
seeds on a config-initialised 2-block BERT classifier of width 128
(``transformers.BertForSequenceClassification``) over the UCI Adult records written as
13-token sequences (``[CLS]`` and one token per attribute; the vocabulary from the public
schema and fixed bucket edges, :mod:`._adult_tokens`), predicting income > 50K: 5,000 of
the 30,162 complete training records for validation, the other 25,162 private, the
15,060 complete test records for the accuracy; epsilon 4 and 8; Adam (plain SGD did not
train this model from its initialisation in a few hundred steps), and a non-private
reference trained the same way.

References
----------
* Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu (2023b), (Amplified)
  Banded Matrix Factorization: A unified approach to private training, NeurIPS.
* McMahan, Jia, Pillutla, Dvijotham et al. (2024), Hassle-Free Matrix Factorization
  Mechanisms for Private Learning (BLTs).
* Chua, Ghazi, Harrison, Kumar, Manurangsi, Sinha & Zhang (2025), Balls-and-Bins
  Sampling for DP-SGD, AISTATS.
* Papernot & Steinke (2022), Hyperparameter Tuning with Renyi Differential Privacy, ICLR.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from privlearn import _validation as _v
from privlearn.errors import ParameterValueError
from privlearn.experiments._common import (
    ExperimentResult,
    accuracy_spread,
    epsilon_log_axis,
    format_table,
    prepare_out_dir,
    progress,
    pyplot,
    save_figure,
    write_csv,
)

__all__ = ["Strategy", "STRATEGIES", "NONPRIVATE", "StudyConfig", "TASKS", "FULL", "QUICK",
           "FULL_ADULT_BERT", "QUICK_ADULT_BERT", "run_correlated_noise",
           "run_correlated_noise_adult_bert", "markdown_tables"]


@dataclass(frozen=True)
class Strategy:
    """A noise strategy of the study and the sampler it runs with.

    Attributes
    ----------
    name : str
        Its label in the tables.
    noise, sampling : str
        ``make_private``'s ``noise`` and ``sampling``.
    size_option : str or None
        The ``make_private`` keyword sized by the study (``"bands"``, ``"buffers"``).
    """

    name: str
    noise: str
    sampling: str
    size_option: str | None = None

    def settings(self, size: int | None) -> dict:
        """The ``make_private`` keywords of this strategy with ``size`` bands or buffers
        (cyclic Poisson sampling: cycle length = bands, the amplified case)."""
        kw: dict = {"noise": self.noise, "sampling": self.sampling}
        if self.size_option is not None:
            kw[self.size_option] = size
        if self.sampling == "cyclic_poisson":
            kw["cycle_length"] = size
        return kw


#: The non-private reference (no clipping, no noise, no sampler; only in the runs file).
NONPRIVATE = Strategy("non-private", "none", "shuffle")

#: The strategies compared, DP-SGD first (the baseline of every ratio).
STRATEGIES: tuple[Strategy, ...] = (
    Strategy("DP-SGD", "dpsgd", "poisson"),
    Strategy("banded", "banded", "cyclic_poisson", "bands"),
    Strategy("BLT", "blt", "balls_in_bins", "buffers"),
)


@dataclass(frozen=True)
class StudyConfig:
    """The settings of the study (immutable; validated when made).

    Attributes
    ----------
    epsilons : tuple of float
    delta : float
    learning_rates : tuple of float
        The tuning grid (plain SGD).
    epochs, batch_size : int
        Epochs and expected batch size (every sampler's).
    hidden : int
        Width of the MLP's hidden layer.
    max_grad_norm : float
    n_validation : int
        Training images held out for the tuning.
    n_train, n_test : int or None
        Private training images (default: all but the validation ones) and test images
        (default all).
    bands : tuple of int
        Candidate bands (= cycle lengths) of the banded strategy.
    buffers : int
        Buffers of the BLT.
    threads : int or None
        PyTorch intra-op threads during the study (restored after; None: unchanged). One
        thread is the fastest for this small model on a shared two-core machine.
    task : {"mnist", "adult-bert"}
        The data and model (:data:`TASKS`): MNIST with the MLP, or the UCI Adult records
        as token sequences with a config-initialised BERT classifier of width ``hidden``
        (:mod:`._adult_tokens`).
    layers : int
        Transformer blocks of the BERT classifier (unused by the MLP).
    optimizer : {"sgd", "adam"}
        Plain SGD (constant learning rate, no momentum), or Adam (PyTorch's default betas
        and eps) under the same noise: the strategies are optimised for SGD's prefix sums,
        and Adam's preconditioning changes that workload.
    nonprivate_reference : bool
        Also train the model without clipping or noise (same optimizer, batch and epochs;
        shuffled fixed-size batches), its learning rate tuned on the same grid and split.
    """

    epsilons: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    delta: float = 1e-5
    learning_rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
    epochs: int = 10
    batch_size: int = 250
    hidden: int = 128
    max_grad_norm: float = 1.0
    n_validation: int = 10_000
    n_train: int | None = None
    n_test: int | None = None
    bands: tuple[int, ...] = (4, 8, 16, 32, 64)
    buffers: int = 4
    threads: int | None = 1
    task: str = "mnist"
    layers: int = 2
    optimizer: str = "sgd"
    nonprivate_reference: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.task not in TASKS:
            raise ParameterValueError(f"task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.optimizer not in ("sgd", "adam"):
            raise ParameterValueError(
                f"optimizer must be 'sgd' or 'adam', got {self.optimizer!r}")
        if not isinstance(self.nonprivate_reference, bool):
            raise _v.ParameterTypeError(
                f"nonprivate_reference must be a bool, got {self.nonprivate_reference!r}")
        for name in ("epsilons", "learning_rates"):
            values = tuple(_v.check_positive(name, float(x)) for x in getattr(self, name))
            if not values:
                raise ParameterValueError(f"{name} must hold at least one value, got ()")
            put(self, name, values)
        put(self, "bands", tuple(_v.check_count("bands", b, minimum=1) for b in self.bands))
        if not self.bands:
            raise ParameterValueError("bands must hold at least one candidate, got ()")
        put(self, "delta", _v.check_delta("delta", self.delta))
        for name in ("epochs", "batch_size", "hidden", "n_validation", "buffers", "layers"):
            put(self, name, _v.check_count(name, getattr(self, name), minimum=1))
        for name in ("n_train", "n_test", "threads"):
            if getattr(self, name) is not None:
                put(self, name, _v.check_count(name, getattr(self, name), minimum=1))
        put(self, "max_grad_norm", _v.check_positive("max_grad_norm", self.max_grad_norm))

    def sizes(self, strategy: Strategy) -> tuple[int | None, ...]:
        """The sizes tried for ``strategy`` (bands candidates, the buffers, or none)."""
        return {"bands": self.bands, "buffers": (self.buffers,)}.get(
            strategy.size_option, (None,))


#: The study's tasks: name -> what is trained on what.
TASKS = {
    "mnist": "MNIST, 784-hidden-10 MLP",
    "adult-bert": "UCI Adult records as 13-token sequences, config-initialised BERT "
                  "classifier (income > 50K)",
}

#: The study as recorded in docs/benchmarks.md.
FULL = StudyConfig()
#: A configuration that runs in seconds (for tests; its numbers are not a result).
QUICK = StudyConfig(epsilons=(8.0,), learning_rates=(1.0, 4.0), epochs=2, batch_size=50,
                    hidden=32, n_validation=500, n_train=2000, n_test=1000, bands=(2, 4))

#: The language-model row as recorded in docs/benchmarks.md: a 2-block BERT classifier of
#: width 128 on Adult, epsilon 4 and 8, DP-Adam (plain SGD did not train this model from
#: its initialisation within the budget), expected batch 125 (sampling rate 0.005, as on
#: MNIST), 1 epoch = 201 steps (sized to run in under an hour on two shared cores).
FULL_ADULT_BERT = StudyConfig(
    task="adult-bert", epsilons=(4.0, 8.0), learning_rates=(0.001, 0.003, 0.01, 0.03, 0.1),
    epochs=1, batch_size=125, hidden=128, layers=2, optimizer="adam", n_validation=5000,
    bands=(4, 8, 16, 32), nonprivate_reference=True)
#: Its small configuration (seconds; not a result).
QUICK_ADULT_BERT = StudyConfig(
    task="adult-bert", epsilons=(8.0,), learning_rates=(0.01,), epochs=1, batch_size=50,
    hidden=32, layers=1, optimizer="adam", n_validation=300, n_train=1000, n_test=500,
    bands=(2,), nonprivate_reference=True)

_BASES = {"mnist": (FULL, QUICK), "adult-bert": (FULL_ADULT_BERT, QUICK_ADULT_BERT)}


def _config(quick: bool, config: StudyConfig | None, overrides: dict) -> StudyConfig:
    task = overrides.get("task", "mnist")
    if config is None and task not in _BASES:
        raise ParameterValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    base = config if config is not None else _BASES[task][1 if quick else 0]
    if not isinstance(base, StudyConfig):
        raise _v.ParameterTypeError(f"config must be a StudyConfig, got {base!r}")
    known = {f.name for f in fields(StudyConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise _v.ParameterTypeError(
            f"unknown option(s) {unknown} of the correlated-noise study; the settings are "
            f"{sorted(known)}")
    return replace(base, **overrides)


def run_correlated_noise(out_dir=None, reps: int | None = None, seed: int = 0, *,
                         quick: bool = False, config: StudyConfig | None = None,
                         data_home=None, download: bool = False, plot: bool = True,
                         show_progress: bool | None = None, verbose: bool = False,
                         **overrides) -> ExperimentResult:
    """Run the study (:data:`FULL`, or :data:`QUICK` with ``quick=True``; ``config`` or
    keyword ``overrides`` of :class:`StudyConfig` change it) and write its files.

    ``reps``: seeds of the final runs at the tuned learning rate (default 3; 1 with
    ``quick``). Returns an :class:`~privlearn.experiments._common.ExperimentResult` whose
    ``rows`` are the table (one per strategy and epsilon) and whose ``summary`` holds the
    tuning cost, the bands considered and the comparison with DP-SGD.
    """
    try:
        from privlearn.experiments import _correlated_torch as ct
    except ImportError as e:
        raise ImportError(f"the correlated-noise study trains PyTorch models and needs the "
                          f"torch extra (pip install 'privlearn[torch]'): {e}") from e
    cfg = _config(quick, config, overrides)
    if cfg.task == "adult-bert":
        try:
            import transformers  # noqa: F401
        except ImportError as e:
            raise ImportError(f"the adult-bert task trains a transformers BERT model and "
                              f"needs the hf extra (pip install 'privlearn[hf]'): {e}") from e
    reps = reps or (1 if quick else 3)
    out = prepare_out_dir(out_dir)
    runs_path = out / "correlated_noise_runs.csv"
    t_start = time.perf_counter()
    if cfg.task == "mnist":
        split = ct.mnist_split(cfg.n_validation, seed, cfg.n_train, cfg.n_test, data_home,
                               download)
        model = dict(task="mnist", hidden=cfg.hidden, layers=cfg.layers, vocab_size=0,
                     length=0)
    else:  # Adult is bundled with privlearn: data_home and download are not used
        from privlearn.experiments._adult_tokens import adult_vocabulary

        vocab = adult_vocabulary()
        split = ct.adult_split(cfg.n_validation, seed, cfg.n_train, cfg.n_test)
        model = dict(task=cfg.task, hidden=cfg.hidden, layers=cfg.layers,
                     vocab_size=vocab.size, length=vocab.length)
    common = dict(delta=cfg.delta, epochs=cfg.epochs, batch_size=cfg.batch_size,
                  max_grad_norm=cfg.max_grad_norm)
    rows: list[dict] = []
    runs: list[dict] = []
    candidates: dict[float, dict[int, float]] = {}
    jobs = ((len(STRATEGIES) * len(cfg.epsilons) + cfg.nonprivate_reference)
            * (len(cfg.learning_rates) + reps))
    cpu_start = time.process_time()
    with ct.torch_threads(cfg.threads):
        bar = progress(total=jobs, desc="correlated noise", enabled=show_progress)
        for eps in cfg.epsilons:
            plans = {}
            t_plan = time.perf_counter()
            for strategy in STRATEGIES:
                tried = {size: ct.plan_strategy(strategy.settings(size), split.x_train,
                                                epsilon=eps, **common)
                         for size in cfg.sizes(strategy)}
                size = min(tried, key=lambda s: tried[s].noise_rmse)
                if strategy.size_option == "bands":
                    candidates[eps] = {b: p.noise_rmse for b, p in tried.items()}
                plans[strategy.name] = (size, tried[size])
            plan_seconds = time.perf_counter() - t_plan
            base_rmse = plans[STRATEGIES[0].name][1].noise_rmse
            for strategy in STRATEGIES:
                size, plan = plans[strategy.name]
                train = dict(epsilon=eps, model=model, optimizer=cfg.optimizer, **common)
                val = {}
                t_tune = 0.0
                for lr in cfg.learning_rates:
                    bar.set_postfix_str(f"{strategy.name} eps={eps:g} lr={lr:g} (tuning)")
                    r = ct.train_once(split, plan, learning_rate=lr, seed=seed * 1000 + 999,
                                      evaluate_on="val", **train)
                    val[lr] = r.accuracy
                    t_tune += r.seconds
                    runs.append(_run_row("tuning", strategy, eps, size, lr, seed * 1000 + 999,
                                         "validation", r))
                    write_csv(runs_path, runs)  # kept up to date: a long run can be followed
                    bar.update(1)
                best = max(cfg.learning_rates, key=lambda lr: val[lr])  # first of ties
                acc, spent, t_final = [], [], 0.0
                for rep in range(reps):
                    bar.set_postfix_str(f"{strategy.name} eps={eps:g} seed {rep + 1}/{reps}")
                    r = ct.train_once(split, plan, learning_rate=best, seed=seed * 1000 + rep,
                                      evaluate_on="test", **train)
                    acc.append(r.accuracy)
                    spent.append(r.epsilon)
                    t_final += r.seconds
                    runs.append(_run_row("final", strategy, eps, size, best, seed * 1000 + rep,
                                         "test", r))
                    write_csv(runs_path, runs)
                    bar.update(1)
                rows.append(dict(
                    method=strategy.name, epsilon=float(eps), delta=cfg.delta,
                    noise=strategy.noise, sampling=strategy.sampling,
                    bands=size if strategy.size_option == "bands" else "",
                    buffers=size if strategy.size_option == "buffers" else "",
                    noise_multiplier=plan.noise_multiplier, steps=plan.steps,
                    expected_batch_size=plan.expected_batch_size,
                    noise_rmse=plan.noise_rmse, noise_rmse_vs_dpsgd=plan.noise_rmse / base_rmse,
                    learning_rate=best, val_accuracy=val[best],
                    **accuracy_spread(acc), epsilon_spent=float(max(spent)),
                    reps=reps, tuning_runs=len(cfg.learning_rates),
                    tuning_seconds=t_tune, final_seconds=t_final,
                    plan_seconds=plan_seconds / len(STRATEGIES)))
        reference = (_reference(split, cfg, model, reps, seed, runs, runs_path, bar)
                     if cfg.nonprivate_reference else None)
        bar.close()
    summary = _summary(rows, runs, candidates, cfg, reps, time.perf_counter() - t_start)
    summary["cpu_seconds"] = float(time.process_time() - cpu_start)
    summary["nonprivate"] = reference
    csv_path = write_csv(out / "correlated_noise.csv", rows)
    md_path = out / "correlated_noise.md"
    md_path.write_text(markdown_tables(rows, summary, cfg) + "\n")
    png = (_plot(rows, cfg, reps, out / "correlated_noise.png", reference)
           if plot else None)
    if verbose:
        print(format_table(rows, ["method", "epsilon", "bands", "noise_multiplier",
                                  "noise_rmse_vs_dpsgd", "learning_rate", "median_accuracy",
                                  "min_accuracy", "max_accuracy", "epsilon_spent"]))
        print(summary["verdict_text"])
    return ExperimentResult("correlated-noise", csv_path, png, rows=rows, summary=summary,
                            extra_paths=[runs_path, md_path])


def _reference(split, cfg: StudyConfig, model: dict, reps: int, seed: int, runs: list,
               runs_path, bar) -> dict:
    """The non-private reference: tuned on the validation split like the strategies,
    then ``reps`` seeds scored on the test set."""
    from privlearn.experiments import _correlated_torch as ct

    train = dict(epochs=cfg.epochs, batch_size=cfg.batch_size, model=model,
                 optimizer=cfg.optimizer)
    val = {}
    for lr in cfg.learning_rates:
        bar.set_postfix_str(f"non-private lr={lr:g} (tuning)")
        r = ct.train_nonprivate(split, learning_rate=lr, seed=seed * 1000 + 999,
                                evaluate_on="val", **train)
        val[lr] = r.accuracy
        runs.append(_run_row("reference-tuning", NONPRIVATE, math.inf, None, lr,
                             seed * 1000 + 999, "validation", r))
        write_csv(runs_path, runs)
        bar.update(1)
    best = max(cfg.learning_rates, key=lambda lr: val[lr])
    acc = []
    for rep in range(reps):
        bar.set_postfix_str(f"non-private seed {rep + 1}/{reps}")
        r = ct.train_nonprivate(split, learning_rate=best, seed=seed * 1000 + rep,
                                evaluate_on="test", **train)
        acc.append(r.accuracy)
        runs.append(_run_row("reference-final", NONPRIVATE, math.inf, None, best,
                             seed * 1000 + rep, "test", r))
        write_csv(runs_path, runs)
        bar.update(1)
    seconds = sum(r["seconds"] for r in runs if r["method"] == NONPRIVATE.name)
    return dict(learning_rate=best, val_accuracy=val[best], **accuracy_spread(acc),
                seconds=float(seconds))


def run_correlated_noise_adult_bert(out_dir=None, reps: int | None = None, seed: int = 0,
                                    **options) -> ExperimentResult:
    """The study's language-model row: :func:`run_correlated_noise` with
    ``task="adult-bert"`` (:data:`FULL_ADULT_BERT`, or :data:`QUICK_ADULT_BERT` with
    ``quick=True``)."""
    if options.get("task", "adult-bert") != "adult-bert":
        raise ParameterValueError(f"this experiment's task is 'adult-bert', got "
                                  f"task={options['task']!r}; run correlated-noise instead")
    options["task"] = "adult-bert"
    return run_correlated_noise(out_dir, reps, seed, **options)


def _run_row(phase: str, strategy: Strategy, eps: float, size, lr: float, seed: int,
             split: str, r) -> dict:
    return dict(phase=phase, method=strategy.name, epsilon=float(eps),
                size="" if size is None else size, learning_rate=lr, seed=seed,
                evaluated_on=split, accuracy=r.accuracy, epsilon_spent=r.epsilon,
                seconds=r.seconds)


def _summary(rows, runs, candidates, cfg: StudyConfig, reps: int, wall: float) -> dict:
    tuning = [r for r in runs if r["phase"] == "tuning"]
    final = [r for r in runs if r["phase"] == "final"]
    by = {(r["method"], r["epsilon"]): r for r in rows}
    base = STRATEGIES[0].name
    verdict = {}
    for eps in cfg.epsilons:
        dp = by[(base, float(eps))]["median_accuracy"]
        best = max((s.name for s in STRATEGIES[1:]),
                   key=lambda n: by[(n, float(eps))]["median_accuracy"])
        acc = by[(best, float(eps))]["median_accuracy"]
        verdict[float(eps)] = dict(best_correlated=best, accuracy=acc, dpsgd=dp,
                                   difference=acc - dp)
    at_least = all(v["difference"] >= 0 for v in verdict.values())
    better_high = all(verdict[e]["difference"] > 0 for e in verdict if e >= 4)
    lines = [f"epsilon {e:g}: best correlated {v['best_correlated']} {v['accuracy']:.4f} vs "
             f"DP-SGD {v['dpsgd']:.4f} ({100 * v['difference']:+.2f} points)"
             for e, v in verdict.items()]
    return dict(
        tuning_runs=len(tuning), tuning_seconds=float(sum(r["seconds"] for r in tuning)),
        final_runs=len(final), final_seconds=float(sum(r["seconds"] for r in final)),
        wall_seconds=float(wall), reps=reps, band_candidates=candidates, verdict=verdict,
        correlated_at_least_dpsgd=at_least, correlated_better_at_high_epsilon=better_high,
        verdict_text="\n".join(lines))


def markdown_tables(rows: list[dict], summary: dict, cfg: StudyConfig) -> str:
    """The study's tables in Markdown: accuracy by epsilon and strategy, the plans and
    tuned learning rates, the bands considered, and the cost of the tuning."""
    names = [s.name for s in STRATEGIES]
    by = {(r["method"], r["epsilon"]): r for r in rows}
    reps = summary["reps"]
    out = [f"Test accuracy, median of {reps} seed{'s' if reps != 1 else ''} (min-max):", "",
           "| epsilon | " + " | ".join(names) + " | best correlated - DP-SGD |",
           "|---:|" + "---:|" * len(names) + "---:|"]
    for eps in cfg.epsilons:
        cells = []
        for n in names:
            r = by[(n, float(eps))]
            cells.append(f"{r['median_accuracy']:.4f} ({r['min_accuracy']:.4f}-"
                         f"{r['max_accuracy']:.4f})")
        d = summary["verdict"][float(eps)]
        out.append(f"| {eps:g} | " + " | ".join(cells)
                   + f" | {100 * d['difference']:+.2f} points ({d['best_correlated']}) |")
    out += ["", "Plans (the engine's calibration) and tuned learning rates:", "",
            "| strategy | epsilon | sampling | bands / buffers | sigma | steps | "
            "noise RMSE / DP-SGD's | tuned lr | val. accuracy | epsilon spent |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        size = r["bands"] if r["bands"] != "" else r["buffers"]
        out.append(f"| {r['method']} | {r['epsilon']:g} | {r['sampling']} | {size or '-'} | "
                   f"{r['noise_multiplier']:.3f} | {r['steps']} | "
                   f"{r['noise_rmse_vs_dpsgd']:.3f} | {r['learning_rate']:g} | "
                   f"{r['val_accuracy']:.4f} | {r['epsilon_spent']:.3f} |")
    cand = summary["band_candidates"]
    if cand:
        bands = sorted({b for c in cand.values() for b in c})
        out += ["", "Banded: noise RMSE of the iterates relative to DP-SGD's, by bands "
                "(= cycle length; the smallest is used):", "",
                "| epsilon | " + " | ".join(f"b={b}" for b in bands) + " |",
                "|---:|" + "---:|" * len(bands)]
        for eps in cfg.epsilons:
            base = by[(names[0], float(eps))]["noise_rmse"]
            out.append(f"| {eps:g} | " + " | ".join(
                f"{cand[eps][b] / base:.3f}" if b in cand[eps] else "-" for b in bands) + " |")
    out += ["", f"Tuning: {summary['tuning_runs']} training runs "
            f"({len(cfg.learning_rates)} learning rates x {len(names)} strategies x "
            f"{len(cfg.epsilons)} epsilons, one seed each), {summary['tuning_seconds']:.0f} s; "
            f"final runs: {summary['final_runs']}, {summary['final_seconds']:.0f} s; wall "
            f"time {summary['wall_seconds']:.0f} s. The tuning reads a held-out split of the "
            "private training data and is not accounted (the epsilons are those of one "
            "training run, as in the papers compared)."]
    ref = summary.get("nonprivate")
    if ref:
        out += ["", f"Non-private reference (same model, optimizer, batch and epochs; "
                f"learning rate {ref['learning_rate']:g} tuned on the same grid and split, "
                f"validation accuracy {ref['val_accuracy']:.4f}): test accuracy "
                f"{ref['median_accuracy']:.4f} ({ref['min_accuracy']:.4f}-"
                f"{ref['max_accuracy']:.4f}), {ref['seconds']:.0f} s."]
    if "cpu_seconds" in summary:
        out += ["", f"Cost of the whole run: {summary['wall_seconds']:.0f} s wall, "
                f"{summary['cpu_seconds']:.0f} s CPU (this process)."]
    return "\n".join(out)


def _plot(rows: list[dict], cfg: StudyConfig, reps: int, path, reference=None):
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2),
                                  gridspec_kw={"width_ratios": [3, 2]})
    eps = np.asarray(cfg.epsilons, dtype=float)
    for s in STRATEGIES:
        mine = [next(r for r in rows if r["method"] == s.name and r["epsilon"] == e)
                for e in eps]
        med = np.array([r["median_accuracy"] for r in mine])
        lo = np.array([r["min_accuracy"] for r in mine])
        hi = np.array([r["max_accuracy"] for r in mine])
        line, = ax.plot(eps, med, "o-", label=s.name)
        ax.fill_between(eps, lo, hi, color=line.get_color(), alpha=0.2)
        ax2.plot(eps, [r["noise_rmse_vs_dpsgd"] for r in mine], "o-", color=line.get_color(),
                 label=s.name)
    if reference:
        ax.axhline(reference["median_accuracy"], color="k", lw=0.8, ls=":",
                   label="non-private")
    epsilon_log_axis(ax, eps)
    epsilon_log_axis(ax2, eps)
    ax.set_xlabel(f"epsilon (delta={cfg.delta:g})")
    ax.set_ylabel("test accuracy")
    what = "MNIST MLP" if cfg.task == "mnist" else f"Adult BERT (width {cfg.hidden})"
    epochs = f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''}"
    ax.set_title(f"{what}, {epochs}, batch {cfg.batch_size}: median of {reps} "
                 "seeds (band: min-max)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    ax2.set_xlabel("epsilon")
    ax2.set_ylabel("noise RMSE of the iterates / DP-SGD's")
    ax2.set_title("theory: noise in the iterates at lr 1", fontsize=10)
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    ax2.set_ylim(0, max(1.2, math.ceil(10 * max(r["noise_rmse_vs_dpsgd"] for r in rows)) / 10))
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)
