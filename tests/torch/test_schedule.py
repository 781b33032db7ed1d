"""How a run is noised and accounted lives in one object,
:class:`privlearn.torch.schedule.NoisePlan` (DP-SGD is its identity strategy): no other
module of the engine tests the noise mode, and the plan's mechanism of the steps taken
is the composition of its steps."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import privlearn
from privlearn.accounting import Gaussian, compose, subsample
from privlearn.correlated import BandedToeplitz, Identity
from privlearn.torch.accountant import PrivacyAccountant, Segment
from privlearn.torch.correlated_noise import CorrelatedNoise
from privlearn.torch.schedule import NoisePlan, RunAccounting

PKG = Path(privlearn.__file__).parent
#: the noise modes (DPConfig.noise) and the members of the Noise enum naming them
MODES = {"dpsgd", "banded", "blt"}
MEMBERS = {"DPSGD", "BANDED", "BLT"}
#: the noise object's module
ALLOWED: dict[str, str | None] = {"torch/schedule.py": None}


def _names_a_mode(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and n.value in MODES:
            return True
        if isinstance(n, ast.Attribute) and n.attr in MEMBERS and (
                isinstance(n.value, ast.Name) and n.value.id == "Noise"):
            return True
    return False


def mode_tests(path: Path, allowed_function: str | None = None) -> list[tuple[int, str]]:
    """(line, source) of every comparison against a noise mode (``==``, ``!=``, ``in``,
    ``is``, a ``match`` case) in ``path``, outside ``allowed_function``."""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == allowed_function:
            skip |= {id(n) for n in ast.walk(node)}
    hits = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare) and _names_a_mode(node):
            hits.append((node.lineno, ast.get_source_segment(text, node) or ""))
        elif isinstance(node, ast.match_case) and _names_a_mode(node.pattern):
            hits.append((node.pattern.lineno, ast.get_source_segment(text, node.pattern)))
    return hits


def test_no_module_outside_the_noise_plan_tests_the_noise_mode():
    offenders = {}
    for area in ("torch", "experiments", "models", "cli"):
        for f in sorted((PKG / area).rglob("*.py")):
            rel = str(f.relative_to(PKG))
            if rel in ALLOWED and ALLOWED[rel] is None:
                continue
            hits = mode_tests(f, ALLOWED.get(rel))
            if hits:
                offenders[rel] = hits
    assert not offenders, offenders


def test_the_mode_scan_finds_a_test(tmp_path):
    """The scanner is not vacuous: it sees each form of test, and not a mere mention."""
    f = tmp_path / "m.py"
    f.write_text(
        "def f(cfg, Noise):\n"
        "    if cfg.noise != 'dpsgd':\n        pass\n"
        "    if cfg.noise in ('banded', 'blt'):\n        pass\n"
        "    if cfg.noise is Noise.BLT:\n        pass\n"
        "    match cfg.noise:\n        case 'banded':\n            pass\n"
        "    return dict(noise='banded')\n"
        "def _check_correlated(self):\n    return self.noise == 'blt'\n")
    assert [line for line, _ in mode_tests(f)] == [2, 4, 6, 9, 13]
    assert [line for line, _ in mode_tests(f, "_check_correlated")] == [2, 4, 6, 9]


def _dpsgd(sigma, q, k):
    return compose(subsample(Gaussian(sigma), rate=q, scheme="poisson"), steps=k)


def test_dpsgd_is_the_identity_strategy_accounted_step_by_step():
    plan = NoisePlan.build("dpsgd", "poisson", 1000, 0.01, 1, 50)
    assert plan.strategy == Identity() and plan.stepwise and not plan.correlates
    assert plan.noise_transform() is None
    # a schedule: segments of different sigma compose as the subsampled Gaussians
    segs = [Segment(1.0, 0.01, 1.0, 30), Segment(1.0, 0.01, 2.0, 10), Segment(2.0, 0.01, 1.0, 5)]
    want = compose([_dpsgd(1.0, 0.01, 40), _dpsgd(2.0, 0.01, 5)])
    got = plan.composed(segs)
    assert math.isclose(got.epsilon(1e-5), want.epsilon(1e-5), rel_tol=1e-9)
    acct = PrivacyAccountant(scheme="poisson", run=plan)
    for s in segs:
        for _ in range(s.steps):
            acct.record_step(s.noise_multiplier, s.sampling_rate, s.max_grad_norm)
    assert math.isclose(acct.epsilon(1e-5), want.epsilon(1e-5), rel_tol=1e-9)
    assert plan.composed([]) is None


def test_a_whole_run_has_one_noise_multiplier_and_its_transform():
    ident = NoisePlan.build("dpsgd", "balls_in_bins", 100, 1.0, 10, 20)
    assert ident.strategy == Identity() and not ident.stepwise and not ident.correlates
    assert ident.noise_transform() is None
    banded = NoisePlan.build("banded", "cyclic_poisson", 100, 0.5, 4, 20, bands=3)
    assert banded.correlates and banded.strategy.bands == 3
    assert isinstance(banded.noise_transform(), CorrelatedNoise)
    assert banded.noise_transform() is not banded.noise_transform()  # fresh state per run
    k = 12
    segs = [Segment(1.5, 0.5, 1.0, 5), Segment(1.5, 0.5, 3.0, k - 5)]  # C may change
    assert math.isclose(banded.composed(segs).epsilon(1e-5),
                        banded.mechanism(1.5, k).epsilon(1e-5), rel_tol=1e-12)
    with pytest.raises(ValueError, match="one noise multiplier"):
        banded.composed([Segment(1.5, 0.5, 1.0, 5), Segment(2.0, 0.5, 1.0, 5)])


def test_a_strategy_given_is_kept_and_the_former_name_works():
    given = BandedToeplitz.square_root(bands=4)
    plan = NoisePlan.build(given, "balls_in_bins", 100, 1.0, 10, 16)
    assert plan.strategy is given and plan.correlates
    assert RunAccounting is NoisePlan
    assert RunAccounting("poisson", 10, 0.1, 1).strategy == Identity()


@pytest.mark.parametrize("sampling", ["balls_in_bins", "cyclic_poisson", "shuffled_epochs"])
def test_a_whole_run_refuses_a_new_noise_multiplier_where_it_is_set(sampling):
    """DP-SGD under a sampling accounted as one mechanism of the run: a new noise
    multiplier after its first step is refused by the setter, naming both values, and
    the run goes on at the old one. It was accepted, and every later step was refused
    from inside the budget check with a bare "a correlated-noise run has one noise
    multiplier" (no value, no remedy), the batch left pending."""
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.errors import ConfigurationError
    from privlearn.torch import make_private

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    model = nn.Linear(4, 2)
    p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8),
                     noise_multiplier=1.0, max_grad_norm=1.0, sampling=sampling, epochs=2,
                     seed=0)
    p.optimizer.noise_multiplier = 1.2  # before the first step: the run's one value
    done = 0
    for _ in range(2):
        for xb, yb in p.data_loader:
            p.optimizer.zero_grad()
            nn.functional.cross_entropy(p.model(xb), yb).backward()
            p.optimizer.step()
            done += 1
            if done == 1:
                with pytest.raises(ConfigurationError, match=r"1\.2 \(kept\), got 1\.5"):
                    p.optimizer.noise_multiplier = 1.5
                assert p.optimizer.noise_multiplier == 1.2
    assert p.accountant.steps == done == 2 * len(p.data_loader)
    assert {s.noise_multiplier for s in p.accountant.segments} == {1.2}
    assert p.epsilon(1e-5) == pytest.approx(
        p.plan.run.mechanism(1.2, done).epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("extra", [{"sampling": "balls_in_bins"},
                                   {"sampling": "cyclic_poisson", "noise": "banded",
                                    "cycle_length": 4}])
def test_a_whole_run_resumes_at_the_noise_multiplier_it_ran_at(extra):
    """A run of one mechanism whose noise multiplier was set before its first step
    resumes from its checkpoint: the live value is restored before the history (after
    it, the run has steps and refuses a new one, and the load stopped half done), and
    the resumed run equals the uninterrupted one (epsilon, parameters bit for bit)."""
    torch = pytest.importorskip("torch")
    import copy

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    ds = TensorDataset(x, (x[:, 0] > 0).long())

    def run(steps, state=None):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        p = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(ds, batch_size=8), noise_multiplier=1.0,
                         max_grad_norm=1.0, epochs=2, seed=0, **extra)
        if state is None:
            p.optimizer.noise_multiplier = 1.2  # before the first step: the run's value
        else:
            p.load_state_dict(state)
        while p.accountant.steps < steps:
            for xb, yb in p.data_loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(xb), yb).backward()
                p.optimizer.step()
                if p.accountant.steps == steps:
                    break
        return p

    half = run(3)
    resumed = run(6, copy.deepcopy(half.state_dict()))
    full = run(6)
    assert resumed.optimizer.noise_multiplier == 1.2
    assert resumed.epsilon(1e-5) == full.epsilon(1e-5)
    for a, b in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(a, b)
