"""Fuzzing of the public boundary: every numeric parameter of the public constructors and
functions (accounting, models, correlated, auditing, ledger, CLI, torch) gets the values a
careless or hostile caller passes, and each call must either succeed with a sane answer
or refuse with a typed error of :mod:`privlearn.errors` naming the parameter.

What counts as a finding (``_outcome`` returns its text):

* a bare built-in error (``OverflowError``, ``MemoryError``, ``RecursionError``,
  ``ZeroDivisionError``, ``IndexError``, ...) instead of a typed refusal;
* a typed ``ParameterValueError``/``ParameterTypeError`` whose message does not name the
  parameter;
* a NumPy ``RuntimeWarning`` (overflow, invalid value, ...) escaping the call;
* a hang (a call still running after :data:`LIMIT_S` seconds: ``SIGALRM``) or an
  allocation beyond :data:`MEMORY_HEADROOM` bytes (a soft address-space limit turns it
  into ``MemoryError``);
* NaN or a string accepted for a number, or a NaN in what a call returns.

The parameters are read with :func:`inspect.signature` (those annotated ``int``/``float``
or with a numeric default), so a new numeric parameter of a covered function is fuzzed
without editing this file. The default run draws a few cases with Hypothesis; the full
sweep of every (function, parameter, value) is marked ``slow``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privlearn import errors

# the time and memory limits of each call need POSIX signals, setrlimit and /proc
resource = pytest.importorskip("resource")
if not hasattr(signal, "SIGALRM") or not os.path.exists("/proc/self/statm"):
    pytest.skip("the fuzz harness needs SIGALRM and /proc/self/statm", allow_module_level=True)

#: Seconds one call may run before it counts as a hang.
LIMIT_S = 8.0
#: Bytes of address space one call may add before an allocation counts as runaway.
MEMORY_HEADROOM = 3 << 30

#: The values tried for every numeric parameter.
VALUES: dict[str, object] = {
    "0": 0,
    "-1": -1,
    "-0.0": -0.0,
    "1e-320": 1e-320,
    "1e308": 1e308,
    "inf": math.inf,
    "-inf": -math.inf,
    "nan": math.nan,
    "2**63": 2**63,
    "2**70": 2**70,
    "True": True,
    "False": False,
    "int64": np.int64(3),
    "float32": np.float32(0.5),
    "0-d": np.array(2.0),
    "str": "3",
    "None": None,
    "list": [1.0, 2.0],
}
#: Values never accepted for a number (a NaN, a string).
MUST_REFUSE = frozenset({"nan", "str"})


class _Hang(BaseException):
    """Raised by the alarm: a BaseException, so no ``except Exception`` swallows it."""


@contextlib.contextmanager
def _limits(seconds: float = LIMIT_S):
    """Run the block under a wall-clock alarm and an address-space cap."""

    def on_alarm(signum, frame):
        raise _Hang

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = used + MEMORY_HEADROOM
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@dataclass
class Target:
    """A public callable: ``call(**overrides)`` runs it on ``base`` updated by the
    overrides; ``params`` are the numeric parameters read from ``signature``."""

    name: str
    call: Callable[..., object]
    signature_of: Callable[..., object]
    base: dict = field(default_factory=dict)
    skip: tuple[str, ...] = ()
    #: parameters that replace another of ``base`` (``epsilon`` for ``pure_epsilon``)
    replaces: dict = field(default_factory=dict)
    #: names the message may use for a parameter (the CLI's ``--noise-multiplier``)
    names: dict = field(default_factory=dict)
    #: the values tried (the CLI's are strings) and those that must be refused
    values: dict = field(default_factory=lambda: VALUES)
    must_refuse: frozenset = MUST_REFUSE
    #: how ``params`` are read (the CLI's: from its click options)
    read_params: Callable[[object], list[str]] | None = None

    @property
    def params(self) -> tuple[str, ...]:
        read = self.read_params or _numeric_params
        return tuple(p for p in read(self.signature_of) if p not in self.skip)

    def run(self, param: str, value: object) -> object:
        kw = dict(self.base)
        kw.pop(self.replaces.get(param, object()), None)
        kw[param] = value
        return self.call(**kw)


_NUMERIC = re.compile(r"\b(int|float)\b")
#: A container of numbers (``tuple[float, ...]``): a sequence parameter, not fuzzed here.
_CONTAINER = re.compile(r"\b(tuple|list|Sequence|Iterable|dict|Callable)\[[^\]]*\]")


def _numeric_params(fn) -> list[str]:
    """The parameters of ``fn`` annotated ``int``/``float`` (alone or in a union, not in
    a container) or whose default is a number."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation if isinstance(p.annotation, str) else repr(p.annotation)
        numeric_default = isinstance(p.default, int | float) and not isinstance(p.default, bool)
        if _NUMERIC.search(_CONTAINER.sub("", ann)) or numeric_default:
            out.append(p.name)
    return out


def _numpy_warning(w: warnings.WarningMessage) -> bool:
    cat = w.category
    return (
        issubclass(cat, RuntimeWarning)
        and not cat.__module__.startswith("privlearn")
        and "encountered" in str(w.message)
    )


def _nan_in(result: object) -> bool:
    if isinstance(result, float | np.floating):
        return math.isnan(result)
    if isinstance(result, np.ndarray) and result.dtype.kind == "f":
        return bool(np.isnan(result).any())
    if isinstance(result, tuple) and len(result) < 10:
        return any(_nan_in(r) for r in result)
    return False


def _outcome(target: Target, param: str, value_id: str) -> str | None:
    """None when the call behaves; otherwise what went wrong."""
    value = target.values[value_id]
    where = f"{target.name}({param}={value_id})"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with _limits():
                result = target.run(param, value)
        except _Hang:
            return f"{where}: still running after {LIMIT_S:g} s"
        except Exception as e:  # noqa: BLE001 - classified below
            mine = type(e).__module__.startswith("privlearn")
            names = (param, *target.names.get(param, ()))
            said = any(n in str(e) for n in names)
            # a divergence is data-dependent, refused with the parameter to change
            if isinstance(e, FloatingPointError) and said:
                return None
            if not mine:
                return f"{where}: bare {type(e).__name__}: {str(e)[:160]}"
            if isinstance(e, errors.ParameterValueError | errors.ParameterTypeError):
                if not said:
                    return f"{where}: {type(e).__name__} not naming {param}: {str(e)[:160]}"
            return None
        finally:
            leaked = [w for w in seen if _numpy_warning(w)]
    if leaked:
        return f"{where}: NumPy warning {leaked[0].message}"
    if value_id in target.must_refuse:
        return f"{where}: accepted {value!r}"
    if _nan_in(result):
        return f"{where}: returned NaN {result!r}"
    return None


# ---------------------------------------------------------------------------------------
# the targets
# ---------------------------------------------------------------------------------------
def _accounting_targets() -> list[Target]:
    from privlearn import accounting as A
    from privlearn.accounting import analytic, closed_form, conversion, fdp, planning

    g = A.compose(A.subsample(A.Gaussian(1.0), 0.01), 100)
    bib = A.BallsInBinsMatrixMechanism(1.0, (1.0, 0.5), 4, 2)

    def fn(f, **base):
        return Target(f"{f.__module__.rsplit('.', 1)[-1]}.{f.__name__}", f, f, base)

    def method(name, m, meth, **base):
        f = getattr(m, meth)
        return Target(f"{name}.{meth}", f, f, base)

    rdp = A.Gaussian(1.0).rdp

    def accounted(
        noise_multiplier: float = 1.0, rate: float = 0.01, steps: int = 10, delta: float = 1e-5
    ):
        """The PLD epsilon of a subsampled Gaussian composition (the mechanism's parameters
        through the accountant)."""
        return A.compose(A.subsample(A.Gaussian(noise_multiplier), rate), steps).epsilon(delta)

    return [
        fn(A.Gaussian, noise_multiplier=1.0),
        fn(A.Laplace, noise_multiplier=1.0),
        fn(A.DiscreteLaplace, noise_parameter=1.0),
        fn(A.RandomizedResponse, truth_probability=0.75),
        Target(
            "PureDP",
            A.PureDP,
            A.PureDP,
            dict(pure_epsilon=1.0),
            replaces={"epsilon": "pure_epsilon"},
        ),
        Target(
            "ApproxDP",
            A.ApproxDP,
            A.ApproxDP,
            dict(dp_epsilon=1.0, dp_delta=1e-5),
            replaces={"epsilon": "dp_epsilon", "delta": "dp_delta"},
        ),
        fn(A.ZCDP, rho=0.5),
        fn(A.MatrixMechanism, noise_multiplier=1.0, sensitivity=1.0),
        fn(
            A.BallsInBinsMatrixMechanism,
            noise_multiplier=1.0,
            strategy_coefs=(1.0, 0.5),
            steps=4,
            cycle_length=2,
        ),
        fn(A.RepeatAndSelect, base=A.Gaussian(1.0), mean=2.0, shape=1.0),
        fn(A.subsample, mechanism=A.Gaussian(1.0), rate=0.01),
        fn(A.compose, mechanisms=A.Gaussian(1.0), steps=10),
        fn(A.calibrate, factory=lambda s: A.compose(A.Gaussian(s), 10), epsilon=1.0, delta=1e-5),
        fn(A.estimate_epsilon, mechanism=bib, delta=1e-5, samples=1000),
        fn(A.planned_steps, sampling_rate=0.01, epochs=2),
        fn(A.steps_per_epoch, sampling_rate=0.01),
        Target(
            "planning.warn_if_delta_large",
            planning.warn_if_delta_large,
            planning.warn_if_delta_large,
            dict(delta=1e-6, n=1000),
            skip=("stacklevel", "default"),
        ),
        Target("accounted epsilon", accounted, accounted),
        method("Mechanism", g, "epsilon", delta=1e-5),
        method("Mechanism", g, "delta", epsilon=1.0),
        method("Mechanism", g, "epsilon_bounds", delta=1e-5),
        method("Mechanism", g, "delta_bounds", epsilon=1.0),
        method("Mechanism", g, "rdp", orders=2.0),
        method("Mechanism", A.Gaussian(1.0), "subsample", rate=0.01),
        method("Mechanism", A.Gaussian(1.0), "compose", steps=10),
        fn(
            conversion.epsilon_from_rdp,
            orders=np.array([2.0, 8.0]),
            rdp=np.array([0.1, 0.5]),
            delta=1e-5,
        ),
        fn(
            conversion.delta_from_rdp,
            orders=np.array([2.0, 8.0]),
            rdp=np.array([0.1, 0.5]),
            epsilon=1.0,
        ),
        fn(conversion.rdp_to_epsilon, rdp_fn=rdp, delta=1e-5),
        fn(conversion.rdp_to_epsilon_and_order, rdp_fn=rdp, delta=1e-5),
        fn(conversion.rdp_to_delta, rdp_fn=rdp, epsilon=1.0),
        fn(fdp.gaussian_tradeoff, mu=1.0, alphas=np.array([0.1, 0.5])),
        fn(fdp.gdp_delta, mu=1.0, epsilon=1.0),
        fn(fdp.gdp_epsilon, mu=1.0, delta=1e-5),
        fn(fdp.gdp_mu, epsilon=1.0, delta=1e-5),
        fn(fdp.gdp_mu_interval, epsilon=1.0, delta=1e-5),
        fn(fdp.gdp_epsilon_interval, mu=1.0, delta=1e-5),
        fn(analytic.gaussian_delta, noise_multiplier=1.0, epsilon=1.0),
        fn(analytic.gaussian_delta_bounds, noise_multiplier=1.0, epsilon=1.0),
        fn(analytic.gdp_delta_bounds, mu=1.0, epsilon=1.0),
        fn(analytic.gaussian_epsilon, noise_multiplier=1.0, delta=1e-5),
        fn(analytic.gaussian_epsilon_bounds, noise_multiplier=1.0, delta=1e-5),
        fn(closed_form.epsilon_bounds, mechanism=A.Laplace(1.0), delta=1e-5),
        fn(closed_form.delta_bounds, mechanism=A.Laplace(1.0), epsilon=1.0),
        fn(closed_form.laplace_epsilon, noise_multiplier=1.0, delta=1e-5),
        fn(closed_form.laplace_delta, noise_multiplier=1.0, epsilon=1.0),
        fn(closed_form.approx_dp_atoms, epsilon=1.0, delta=1e-5),
        fn(closed_form.pure_dp_atoms, epsilon=1.0),
        fn(closed_form.randomized_response_atoms, p=0.75, k=2),
        fn(closed_form.pure_dp_composition_epsilon, epsilons=[1.0, 0.5], delta=1e-5),
    ]


_rng = np.random.default_rng(0)
_X = _rng.uniform(-1, 1, (40, 3))
_Y_CLS = (_X[:, 0] > 0).astype(int)
_Y_REG = _X[:, 0].copy()


def _model_targets() -> list[Target]:
    import privlearn.models as M

    def fit(cls, y, **base):
        def call(**kw):
            return cls(**kw).fit(_X, y)

        return Target(cls.__name__, call, cls.__init__, base)

    def knn(**kw):
        return M.PrivateKNN(**kw).fit(_X, _Y_CLS).release(_X[:3])

    def knn_release(**kw):
        est = M.PrivateKNN(classes=[0, 1], random_state=0).fit(_X, _Y_CLS)
        return est.release(**kw)

    def pate_release(**kw):
        return M.PATE(random_state=0).release(**kw)

    votes = _rng.integers(0, 2, (20, 5))
    grid = {"epsilon": [0.5, 1.0]}
    return [
        fit(M.SSPRegressor, _Y_REG, random_state=0),
        fit(M.AdaSSPRegressor, _Y_REG, random_state=0),
        fit(M.NoisyGDRegressor, _Y_REG, n_iter=5, random_state=0),
        fit(M.DPSGDClassifier, _Y_CLS, n_iter=5, classes=[0, 1], random_state=0),
        fit(M.DPSGDRegressor, _Y_REG, n_iter=5, random_state=0),
        fit(M.PrivateStandardScaler, None, feature_range=(-1, 1), random_state=0),
        Target("PrivateKNN", knn, M.PrivateKNN.__init__, dict(classes=[0, 1], random_state=0)),
        Target("PrivateKNN.release", knn_release, M.PrivateKNN.release, dict(X_query=_X[:3])),
        Target(
            "PATE.release",
            pate_release,
            M.PATE.release,
            dict(teacher_outputs=votes, n_classes=2, n_teachers=20),
        ),
        Target(
            "PATE",
            lambda **kw: M.PATE(**kw).release(votes, 2, n_teachers=20),
            M.PATE.__init__,
            dict(random_state=0),
        ),
        Target(
            "PrivateSearchCV",
            lambda **kw: M.PrivateSearchCV(M.SSPRegressor(), grid, **kw).fit(_X, _Y_REG),
            M.PrivateSearchCV.__init__,
            dict(loss_bound=1.0, random_state=0),
        ),
    ]


def _correlated_targets() -> list[Target]:
    from privlearn import correlated as C

    def fn(f, **base):
        return Target(f"correlated.{f.__name__}", f, f, base)

    return [
        fn(C.optimize_banded_toeplitz, steps=8, bands=2, max_iterations=5, show_progress=False),
        fn(C.optimize_blt, steps=8, buffers=1, max_iterations=5, show_progress=False),
        fn(C.optimize_dense, steps=4, max_iterations=5, show_progress=False),
        fn(C.loss, strategy=C.BandedToeplitz((1.0, 0.5)), steps=8),
        fn(C.per_query_error, strategy=C.BandedToeplitz((1.0, 0.5)), steps=8),
        fn(
            C.sensitivity,
            strategy=C.BandedToeplitz((1.0, 0.5)),
            participation=C.SingleParticipation(),
            steps=8,
        ),
        fn(C.MomentumPrefixSum, momentum=0.5),
        fn(C.FixedEpochs, epochs=2),
        fn(C.MinSeparation, min_sep=2),
    ]


def _audit_ledger_targets(tmp: str) -> list[Target]:
    from privlearn import auditing as Au
    from privlearn.accounting import Gaussian
    from privlearn.ledger import Ledger

    scores_in, scores_out = np.linspace(0, 1, 50), np.linspace(-0.5, 0.5, 50)

    def train_and_score(inclusion):
        return np.where(inclusion, 1.0, 0.0) + _rng.normal(0, 1, inclusion.shape)

    def fn(f, **base):
        return Target(f"auditing.{f.__name__}", f, f, base)

    counter = iter(range(10**9))

    def ledger_init(**kw):
        with Ledger(os.path.join(tmp, f"l{next(counter)}.db"), create=True) as led:
            return led.create_budget("d", **kw)

    def ledger_spend(noise_multiplier: float = 5.0, steps: int = 10):
        """A spend on a fresh ledger; a refused one must leave it as it was."""
        from privlearn.accounting import compose, subsample

        with Ledger(os.path.join(tmp, f"s{next(counter)}.db"), create=True) as led:
            led.create_budget("d", 1.0, 1e-5)
            try:
                led.spend("d", compose(subsample(Gaussian(noise_multiplier), 0.01), steps))
            except Exception as err:
                after = led.spent("d")
                if after.entries or after.epsilon_spent or not led.verify().ok:
                    raise AssertionError(f"a refused spend changed the ledger: {after}") from err
                raise
            return led.spent("d").epsilon_spent

    return [
        fn(Au.epsilon_lower_bound, in_scores=scores_in, out_scores=scores_out, delta=1e-5),
        fn(Au.tpr_at_fpr, in_scores=scores_in, out_scores=scores_out, fpr=0.1),
        fn(
            Au.one_run_audit,
            train_and_score=train_and_score,
            n_canaries=100,
            claimed_epsilon=1.0,
            delta=1e-5,
            seed=0,
        ),
        Target(
            "Ledger.create_budget",
            ledger_init,
            Ledger.create_budget,
            dict(epsilon=1.0, delta=1e-5),
            skip=("dataset",),
        ),
        Target(
            "Ledger(timeout)",
            lambda **kw: Ledger(os.path.join(tmp, "t.db"), create=True, **kw).close(),
            Ledger.__init__,
            {},
        ),
        Target("Ledger.spend", ledger_spend, ledger_spend, {}),
    ]


#: What the CLI is given for a numeric option (strings, as a shell passes them).
CLI_VALUES: dict[str, str] = {
    "0": "0",
    "-1": "-1",
    "-0.0": "-0.0",
    "1e-320": "1e-320",
    "1e308": "1e308",
    "inf": "inf",
    "-inf": "-inf",
    "nan": "nan",
    "2**63": str(2**63),
    "2**70": str(2**70),
    "2.5": "2.5",
    "str": "abc",
}


def _cli_options(command) -> list[str]:
    """The numeric options of a click command (``--steps``, ...)."""
    import click

    numeric = (click.types.IntParamType, click.types.FloatParamType)
    return [
        p.opts[0]
        for p in command.params
        if isinstance(p, click.Option) and isinstance(p.type, numeric)
    ]


def _cli_targets(tmp: str) -> list[Target]:
    from click.testing import CliRunner

    from privlearn.cli import cli

    counter = iter(range(10**9))

    def command(*path: str, base: dict, before=None, skip=()) -> Target:
        cmd = cli
        for part in path:
            cmd = cmd.commands.get(part, cmd) if hasattr(cmd, "commands") else cmd

        def call(**opts):
            args = list(path)
            if before is not None:
                args += before()
            for opt, val in opts.items():
                args += [opt, val]
            res = CliRunner().invoke(cli, args)
            if res.exit_code == 2:
                raise errors.ParameterValueError(res.output)
            if res.exit_code not in (0, 3):  # 3: a spend the ledger refused
                raise RuntimeError(
                    f"exit status {res.exit_code}: {res.output[-300:]}{res.exception!r}"
                )
            return res.output

        return Target(
            "cli " + " ".join(path),
            call,
            cmd,
            base,
            skip=skip,
            values=CLI_VALUES,
            read_params=_cli_options,
        )

    def new_ledger() -> list[str]:
        return [os.path.join(tmp, f"c{next(counter)}.db")]

    def ledger_with_budget() -> list[str]:
        path = new_ledger()
        CliRunner().invoke(
            cli, ["budget", "init", *path, "--dataset", "d", "--epsilon", "1", "--delta", "1e-5"]
        )
        return path

    rate = {"--sampling-rate": "0.01", "--steps": "10"}
    return [
        command("epsilon", base={"--noise-multiplier": "1.0", "--delta": "1e-5", **rate}),
        command("calibrate", base={"--target-epsilon": "1.0", "--delta": "1e-5", **rate}),
        command(
            "budget",
            "init",
            before=new_ledger,
            base={"--dataset": "d", "--epsilon": "1", "--delta": "1e-5"},
        ),
        command(
            "budget",
            "spend",
            before=ledger_with_budget,
            base={"--dataset": "d", "--noise-multiplier": "5", **rate},
        ),
        command("budget", "show", before=ledger_with_budget, base={}),
        # (a valid --seed would run the experiment: only --reps, whose values here are all
        # refused before anything runs)
        command("reproduce", "linear-regression", base={"--out": tmp}, skip=("--seed",)),
    ]


def _torch_targets() -> list[Target]:
    torch = pytest.importorskip("torch")
    from privlearn.torch import make_private

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))

    def call(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(data, batch_size=8)
        run = make_private(model, opt, loader, **kw)
        for x, y in run.data_loader:
            run.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(run.model(x), y).backward()
            run.optimizer.step()
            break
        if not all(torch.isfinite(p).all() for p in run.model.parameters()):
            return math.nan
        return run

    return [
        Target(
            "torch.make_private",
            call,
            make_private,
            dict(noise_multiplier=1.0, max_grad_norm=1.0, steps=4, seed=0),
            replaces={"epochs": "steps"},
        )
    ]


def _targets(tmp: str, torch: bool = False) -> list[Target]:
    return (
        _accounting_targets()
        + _model_targets()
        + _correlated_targets()
        + _audit_ledger_targets(tmp)
        + _cli_targets(tmp)
        + (_torch_targets() if torch else [])
    )


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Target]:
    return {t.name: t for t in _targets(str(tmp_path_factory.mktemp("fuzz")))}


def _case_ids() -> list[tuple[str, str, str]]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return [(t.name, p, v) for t in _targets(tmp) for p in t.params for v in t.values]


CASES = _case_ids()


#: Findings left alone, each a slow accounting path at an extreme that runs past
#: :data:`LIMIT_S` (none answers wrongly), or a refusal that names the derived quantity:
#: ``{(target, parameter): value ids}``.
_PLD_TINY_DELTA = {"1e-320"}  # the PLD accountant's tilted composition: minutes
KNOWN: dict[tuple[str, str], set[str]] = {
    ("Mechanism.epsilon", "delta"): _PLD_TINY_DELTA,
    ("accounted epsilon", "delta"): _PLD_TINY_DELTA,
    ("Mechanism.epsilon_bounds", "delta"): _PLD_TINY_DELTA,
    ("cli epsilon", "--delta"): _PLD_TINY_DELTA,
    ("cli calibrate", "--delta"): _PLD_TINY_DELTA,
    ("torch.make_private", "target_delta"): _PLD_TINY_DELTA,
    ("PrivateKNN", "delta"): {"1e-320", "float32"},  # 0.5: a slow calibration
    # calibrations toward an absurd target (epsilon 1e-320 or 1e308, 2**70 steps) and a
    # huge noise multiplier evaluate the PLD at extreme noise: seconds per evaluation
    ("cli calibrate", "--target-epsilon"): {"1e-320", "1e308", "2**63", "2**70"},
    ("cli calibrate", "--steps"): {"2**70"},
    ("PrivateKNN", "epsilon"): {"1e-320", "1e308", "2**63", "2**70"},
    ("torch.make_private", "noise_multiplier"): {"2**63", "2**70", "1e308"},  # and below
    ("torch.make_private", "max_epsilon"): {"1e308", "2**63", "2**70"},  # the cap's search
}
#: Targets whose calls calibrate (a second or more each): in the sweep only.
SLOW_TARGETS = {
    "accounted epsilon",
    "PrivateKNN",
    "cli calibrate",
    "Mechanism.epsilon",
    "Mechanism.epsilon_bounds",
    "Mechanism.delta",
    "Mechanism.delta_bounds",
    "PrivateSearchCV",
    "montecarlo.estimate_epsilon",
    "auditing.epsilon_lower_bound",
}


def _known(name: str, param: str, value_id: str) -> bool:
    return value_id in KNOWN.get((name, param), ())


def test_every_target_has_numeric_parameters(targets) -> None:
    # the signature reading finds something to fuzz in every target (a renamed parameter
    # or a lost annotation would silently fuzz nothing)
    empty = [name for name, t in targets.items() if not t.params]
    assert not empty, empty


@settings(max_examples=10, deadline=None)
@given(case=st.sampled_from([c for c in CASES if c[0] not in SLOW_TARGETS and not _known(*c)]))
def test_public_boundary_sample(targets, case) -> None:
    name, param, value_id = case
    assert _outcome(targets[name], param, value_id) is None


def _sweep(target: Target) -> None:
    found = [
        f
        for param in target.params
        for v in target.values
        if not _known(target.name, param, v) and (f := _outcome(target, param, v))
    ]
    assert not found, "\n".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted({c[0] for c in CASES}))
def test_public_boundary_sweep(targets, name) -> None:
    _sweep(targets[name])


@pytest.mark.slow
def test_make_private_sweep() -> None:
    _sweep(_torch_targets()[0])


# ---------------------------------------------------------------------------------------
# the findings fixed, each at its source (every case failed before its fix: a bare error,
# a hang, a NumPy warning or a message not naming the parameter)
# ---------------------------------------------------------------------------------------
def test_training_step_counts_share_one_upper_bound() -> None:
    from privlearn import _validation as v
    from privlearn.models.constraints import MAX_ITERATIONS

    assert MAX_ITERATIONS == v.MAX_STEPS == 2**31 - 1
    assert v.check_steps("steps", 2**31 - 1) == 2**31 - 1
    for bad in (2**31, 2**63, 2**70, np.int64(2**62)):
        with pytest.raises(
            errors.ParameterValueError,
            match=r"^steps must be an integer in \[1, 2,147,483,647\], got "
            r"\d+; more than 2\*\*31 - 1 .* e\.g\. 1000$",
        ):
            v.check_steps("steps", bad)


@pytest.mark.parametrize(("param", "value"), [("steps", 2**70), ("epochs", 2**63)])
def test_make_private_refuses_absurd_step_counts(param, value) -> None:
    # the plan's accountant ran without end on 2**70 steps
    t = _torch_targets()[0]
    with (
        _limits(),
        pytest.raises(
            errors.ParameterValueError,
            match=rf"^{param} must be an integer in \[1, 2,147,483,647\]"
            rf", got {value}; .* e\.g\. {param}=10$",
        ),
    ):
        t.run(param, value)


def test_trajectory_points_is_bounded() -> None:
    from privlearn.models import DPSGDRegressor

    # a long run evaluated epsilon at every one of its steps (and 2**70 points allocated
    # the step grid of the whole run)
    with pytest.raises(
        errors.ParameterValueError,
        match=r"^trajectory_points must be an integer in \[1, 10,000\], got "
        r"1180591620717411303424; each point is one accountant",
    ):
        DPSGDRegressor(n_iter=5, trajectory_points=2**70).fit(_X, _Y_REG)
    from privlearn.models.constraints import TRAJECTORY_POINTS

    assert TRAJECTORY_POINTS("trajectory_points", 10**4) == 10**4


@pytest.mark.parametrize("seed", [-1, 0.5, np.float32(0.5), "3", [1, 2], math.nan])
def test_estimate_epsilon_checks_its_seed(seed) -> None:
    from privlearn.accounting import BallsInBinsMatrixMechanism, estimate_epsilon

    bib = BallsInBinsMatrixMechanism(1.0, (1.0, 0.5), 4, 2)
    with pytest.raises(
        ValueError,
        match=r"^seed must be an integer >= 0, got .*; pass an "
        r"int >= 0 such as 0, or None",
    ) as info:
        estimate_epsilon(bib, 1e-5, samples=100, seed=seed)
    assert isinstance(info.value, errors.ParameterValueError | errors.ParameterTypeError)
    ok = estimate_epsilon(bib, 1e-5, samples=100, seed=np.array(3))
    assert ok == estimate_epsilon(bib, 1e-5, samples=100, seed=3)


def test_estimate_epsilon_bounds_its_samples() -> None:
    from privlearn.accounting import BallsInBinsMatrixMechanism, estimate_epsilon

    bib = BallsInBinsMatrixMechanism(1.0, (1.0, 0.5), 4, 2)
    # 10**9 samples (16 GB of arrays, hours of work) was taken up
    with (
        _limits(),
        pytest.raises(
            errors.ParameterValueError,
            match=r"^samples must be an integer in \[100, 100,000,000\], got 1000000000;",
        ),
    ):
        estimate_epsilon(bib, 1e-5, samples=10**9)


@pytest.mark.parametrize("cls", ["SSPRegressor", "AdaSSPRegressor", "NoisyGDRegressor"])
@pytest.mark.parametrize("x_bound", [1e-320, 1e-200])
def test_a_subnormal_squared_x_bound_is_refused(cls, x_bound) -> None:
    # NoisyGD divided by its square (ZeroDivisionError); the others released noise whose
    # scale underflowed to the subnormal range
    import privlearn.models as M

    with pytest.raises(
        errors.ParameterValueError,
        match=rf"x_bound={x_bound!r} is too small: .* underflows float64",
    ):
        getattr(M, cls)(x_bound=x_bound).fit(_X, _Y_REG)


def test_a_subnormal_search_eta_is_the_logarithmic_limit() -> None:
    # eta = 1e-320: 1 - gamma^eta rounded to 0 (ZeroDivisionError in the fit)
    mp = pytest.importorskip("mpmath")
    from privlearn.accounting.repeat_select import _expected_runs
    from privlearn.models import PrivateSearchCV, SSPRegressor

    mp.mp.dps = 50
    for gamma in (1e-6, 0.3, 0.99):
        eta, g = mp.mpf(1e-320), mp.mpf(gamma)
        exact = eta * (1 - g) / (g * -mp.expm1(eta * mp.log(g)))
        assert float(abs(_expected_runs(1e-320, gamma) / exact - 1)) < 1e-14
    search = PrivateSearchCV(
        SSPRegressor(), {"epsilon": [0.5, 1.0]}, loss_bound=1.0, eta=1e-320, random_state=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.DataClippedWarning)
        assert math.isfinite(search.fit(_X, _Y_REG).epsilon_)


def test_an_overflowing_given_noise_multiplier_is_named() -> None:
    from privlearn.models import NoisyGDRegressor

    with pytest.raises(
        errors.ConfigurationError,
        match=r"noise_multiplier=1e\+308\. .* Pass a smaller noise_multiplier",
    ):
        NoisyGDRegressor(n_iter=5, noise_multiplier=1e308).fit(_X, _Y_REG)


def test_huge_epsilon_and_orders_warn_nothing() -> None:
    # "overflow encountered in multiply" (theta * epsilon in the PLD tilts, k * rdp in a
    # composition) reached the caller
    from privlearn.accounting import Gaussian, compose, subsample

    m = compose(subsample(Gaussian(2.0), 0.5), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert 0.0 <= m.delta(1e308) < 1e-300
        assert compose(subsample(Gaussian(1.0), 0.5), 100).rdp(1e308) == math.inf


@pytest.mark.parametrize("cls", ["DPSGDRegressor", "DPSGDClassifier"])
def test_a_divergence_from_l2_regularization_names_it(cls) -> None:
    # the message advised only a smaller learning_rate when l2_regularization=1e308 made
    # every step multiply the iterate by 1 - 1e308
    import privlearn.models as M

    kw = dict(classes=[0, 1]) if cls == "DPSGDClassifier" else {}
    y = _Y_CLS if cls == "DPSGDClassifier" else _Y_REG
    est = getattr(M, cls)(n_iter=5, l2_regularization=1e308, random_state=0, **kw)
    with (
        warnings.catch_warnings(),
        pytest.raises(
            FloatingPointError,
            match=r"l2_regularization=1e\+308\); use a smaller learning_rate, "
            r"and keep learning_rate \* l2_regularization below 2",
        ),
    ):
        warnings.simplefilter("error", RuntimeWarning)  # nor "overflow encountered" first
        est.fit(_X, y)


def test_an_essentially_non_private_mechanism_warns_nothing() -> None:
    # a noise multiplier of 1e-300 filled the PLD grids with inf and NaN: hundreds of
    # "invalid value" / "divide by zero" warnings before the typed refusal
    from privlearn.accounting import Gaussian, compose, subsample

    m = compose(subsample(Gaussian(1e-300), 0.01), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(errors.PrivacyLossOverflowError, match="essentially non"):
            m.epsilon(1e-5)
        assert m.delta(1.0) == 1.0  # no guarantee at all: every mechanism is (0, 1)-DP


def test_reproduce_bounds_its_repetitions() -> None:
    # --reps 2**70 ended in a traceback (NumPy: "Maximum allowed dimension exceeded")
    from click.testing import CliRunner

    from privlearn.cli import cli
    from privlearn.experiments import run_experiment

    res = CliRunner().invoke(cli, ["reproduce", "linear-regression", "--reps", str(2**70)])
    assert res.exit_code == 2, res.output
    assert "--reps must be an integer in [1, 1,000,000], got 1180591620717411303424" in (res.output)
    with pytest.raises(errors.ParameterValueError, match=r"^reps must be an integer in \[1, "):
        run_experiment("linear-regression", reps=2**63)
