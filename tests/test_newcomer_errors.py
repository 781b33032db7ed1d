"""The refusals a newcomer meets first say what to do instead, and what they suggest is
what the documentation teaches.

A delta of ``1 / n`` or more is no guarantee at all (publishing one random record of
``n`` in the clear is ``(0, 1/n)``-DP; Dwork & Roth 2014, Section 2.3), so a refused delta
must not be pointed at ``1 / dataset size``: every public entry point that checks a delta
suggests a value well below it. A classifier given labels outside its public ``classes``
(string labels against the default-looking ``[0, 1]``) says how to list them.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from privlearn.accounting import Gaussian, compose
from privlearn.cli import cli
from privlearn.errors import ParameterValueError
from privlearn.models import DPSGDClassifier


def _assert_delta_hint(message: str) -> None:
    assert "well below 1 / dataset size" in message, message
    assert "or 1/dataset size" not in message, message


@pytest.mark.parametrize("accountant", ["pld", "rdp", "analytic"])
def test_accounting_delta_refusal_suggests_well_below_one_over_n(accountant: str) -> None:
    with pytest.raises(ParameterValueError) as err:
        compose(Gaussian(1.0), steps=3).epsilon(2.0, accountant=accountant)
    assert "got 2.0" in str(err.value)
    _assert_delta_hint(str(err.value))


def test_cli_delta_refusal_suggests_well_below_one_over_n() -> None:
    r = CliRunner().invoke(cli, ["epsilon", "--noise-multiplier", "1", "--delta", "2"])
    assert r.exit_code == 2
    assert "--delta must be in [0, 1), got 2.0" in r.output
    _assert_delta_hint(r.output)


def test_make_private_target_delta_refusal_suggests_well_below_one_over_n() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    model = torch.nn.Linear(3, 2)
    loader = DataLoader(
        TensorDataset(torch.zeros(10, 3), torch.zeros(10, dtype=torch.long)), batch_size=2
    )
    with pytest.raises(ParameterValueError) as err:
        make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            noise_multiplier=1.0,
            target_delta=2.0,
        )
    assert "target_delta" in str(err.value)
    _assert_delta_hint(str(err.value))


def test_classifier_with_text_labels_says_how_to_list_them() -> None:
    X = np.random.default_rng(0).random((20, 2))
    y = np.array(["no", "yes"] * 10)
    with pytest.raises(ParameterValueError) as err:
        DPSGDClassifier(epsilon=1.0, delta=1e-5, n_iter=5, classes=[0, 1], random_state=0).fit(X, y)
    message = str(err.value)
    assert "classes=[0, 1]" in message and "['no', 'yes']" in message  # given and received
    assert "classes=['no', 'yes']" in message  # what to try


@pytest.mark.parametrize(
    "factory, bounds, integer",
    [
        (lambda s: Gaussian(s), (1.0, 10.0), False),  # noise: the upper bound is too small
        (lambda k: compose(Gaussian(1.0), steps=int(k)), (1, 10), True),  # steps: too many
        (lambda k: compose(Gaussian(1.0), steps=int(k)), None, True),  # even one step
    ],
)
def test_unreachable_calibration_says_what_to_change(factory, bounds, integer) -> None:
    from privlearn.accounting import CalibrationError, calibrate

    with pytest.raises(CalibrationError) as err:
        calibrate(factory, epsilon=0.001, delta=1e-9, bounds=bounds, integer=integer)
    message = str(err.value)
    assert "target epsilon=0.001 unreachable" in message and "delta=1e-09" in message
    assert "loosen the target (a larger epsilon or delta)" in message


def test_pipeline_encoding_step_not_listed_public_says_how_to_list_it() -> None:
    """The usual first try: a ColumnTransformer over public category lists, forgotten in
    public_steps. The refusal names the setting to add, with the step's own name."""
    pd = pytest.importorskip("pandas")
    from sklearn.compose import ColumnTransformer
    from sklearn.preprocessing import OneHotEncoder

    from privlearn.errors import ParameterTypeError
    from privlearn.models import PrivatePipeline

    X = pd.DataFrame({"sex": ["Female", "Male"] * 10, "age": np.linspace(0.1, 0.9, 20)})
    y = np.array([0, 1] * 10)
    encode = ColumnTransformer(
        [("text", OneHotEncoder(categories=[["Female", "Male"]], sparse_output=False), ["sex"])],
        remainder="passthrough",
    )
    pipe = PrivatePipeline(
        [("encode", encode), ("clf", DPSGDClassifier(delta=1e-5, n_iter=5, classes=[0, 1]))]
    )
    with pytest.raises(ParameterTypeError) as err:
        pipe.fit(X, y)
    assert "public_steps=('encode',)" in str(err.value)
    assert "_public_fits" not in str(err.value)  # a private module is no advice
    pipe.set_params(public_steps=("encode",)).fit(X, y)  # and the advice works
    assert pipe.epsilon_ <= 1.0


def test_calibrating_a_rate_without_bounds_says_to_pass_them() -> None:
    """The search without bounds probes the parameters 1 and 2: a sampling rate of 2 is
    refused by the factory, which used to surface as 'rate must be in (0, 1], got 2.0', a
    value the user never passed. The refusal now says which bounds to give, and they work."""
    from privlearn.accounting import CalibrationError, calibrate, subsample

    def factory(q):
        return compose(subsample(Gaussian(1.1), rate=q), steps=14040)

    with pytest.raises(CalibrationError) as err:
        calibrate(factory, epsilon=3.0, delta=1e-5)
    assert "bounds=(1e-9, 1.0) for a sampling rate" in str(err.value)
    rate = calibrate(factory, epsilon=3.0, delta=1e-5, bounds=(1e-9, 1.0))
    assert factory(rate).epsilon(1e-5) <= 3.0 < factory(rate * 1.01).epsilon(1e-5)


def test_cli_budget_init_again_says_what_to_do_in_the_shells_words(tmp_path) -> None:
    """A second `budget init` of the same dataset (a setup script run twice) is refused;
    from the shell the advice names the shell's commands and options, not the Python
    calls (`ledger.budget(dataset)`, `create_budget(..., exist_ok=True)`), which Python's
    own refusal keeps."""
    from privlearn.errors import LedgerConflictError
    from privlearn.ledger import Ledger

    db = str(tmp_path / "privacy.db")
    args = ["budget", "init", db, "--dataset", "adult", "--epsilon", "1", "--delta", "1e-6"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    for extra in ([], ["--epsilon", "2", "--exist-ok"]):  # same budget; another one
        r = CliRunner().invoke(cli, [*args, *extra])
        assert r.exit_code == 2, r.output
        assert f"`privlearn budget spend {db} --dataset adult ...`" in r.output, r.output
        assert "ledger.budget(" not in r.output and "create_budget(" not in r.output
    r = CliRunner().invoke(cli, args)
    assert "pass --exist-ok" in r.output, r.output
    with pytest.raises(LedgerConflictError) as err:
        Ledger(db).create_budget("adult", epsilon=1.0, delta=1e-6)
    assert "create_budget(..., exist_ok=True)" in str(err.value)
    assert err.value.existing is not None and err.value.existing.epsilon == 1.0


def test_cli_json_help_says_what_json_prints(tmp_path) -> None:
    """`--help` says "one JSON object" only where one object is printed: `budget history
    --json` prints a list (one object per entry), `budget show --json` without --dataset
    a list of budgets."""
    import json

    db = str(tmp_path / "privacy.db")
    init = ["budget", "init", db, "--dataset", "adult", "--epsilon", "1", "--delta", "1e-6"]
    assert CliRunner().invoke(cli, init).exit_code == 0
    for command in (["history"], ["show"], ["show", "--dataset", "adult"]):
        out = CliRunner().invoke(cli, ["budget", *command, db, "--json"]).output
        printed = json.loads(out)
        help_text = " ".join(
            CliRunner().invoke(cli, ["budget", command[0], "--help"]).output.split()
        )
        json_help = help_text.split("--json", 1)[1]
        if isinstance(printed, list):
            assert "JSON list" in json_help, (command, json_help)
        else:
            assert "one JSON object" in json_help, (command, json_help)


def test_cli_help_of_reps_says_its_default() -> None:
    help_text = " ".join(CliRunner().invoke(cli, ["reproduce", "--help"]).output.split())
    reps = help_text.split("--reps INTEGER", 1)[1].split("--seed", 1)[0]
    assert "default" in reps, reps


def test_cli_calibrate_names_its_epsilon_as_epsilon_does() -> None:
    """`calibrate` and `epsilon` print the same kind of number, the certified upper bound,
    and say so in the same words; a one-epoch schedule reads '1 epoch'."""
    run = ["--batch-size", "10", "--dataset-size", "100", "--epochs", "1", "--delta", "1e-5"]
    eps = CliRunner().invoke(cli, ["epsilon", "--noise-multiplier", "1.2", *run]).output
    cal = CliRunner().invoke(cli, ["calibrate", "--target-epsilon", "2", *run]).output
    assert "(certified upper bound, pld accountant)" in eps
    assert "(certified upper bound, pld accountant)" in cal, cal
    for out in (eps, cal):
        assert "steps = 1 epoch x 10 steps per epoch" in out, out


def test_calibration_progress_bar_counts_in_words(capsys) -> None:
    """The calibration bar of make_private reads '3 evaluations', not '3evaluation'."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    model = torch.nn.Linear(3, 2)
    loader = DataLoader(
        TensorDataset(torch.zeros(100, 3), torch.zeros(100, dtype=torch.long)), batch_size=10
    )
    make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        target_epsilon=2.0,
        target_delta=1e-5,
        steps=5,
        show_progress=True,
    )
    err = capsys.readouterr().err
    assert "calibrating the noise for 5 steps" in err
    assert " evaluations" in err and "0evaluation" not in err, err


def test_resuming_with_more_epochs_says_how_to_train_longer() -> None:
    """A newcomer's checkpoint of a run calibrated for 2 epochs, loaded into one built with
    `epochs=3` to train longer: refused (another noise multiplier), and the refusal says how
    to go on (the saved noise multiplier instead of target_epsilon), which works."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.errors import ConfigurationError
    from privlearn.torch import make_private

    X = torch.randn(100, 3, generator=torch.Generator().manual_seed(0))
    y = (X[:, 0] > 0).long()

    def build(**privacy):
        model = torch.nn.Linear(3, 2)
        loader = DataLoader(TensorDataset(X, y), batch_size=20)
        return make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loader, target_delta=1e-5, **privacy
        )

    first = build(target_epsilon=2.0, epochs=2)
    for xb, yb in first.data_loader:
        first.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(first.model(xb), yb).backward()
        first.optimizer.step()
    state = first.state_dict()
    with pytest.raises(ConfigurationError) as err:
        build(target_epsilon=2.0, epochs=3).load_state_dict(state)
    saved = first.noise_multiplier
    assert f"noise_multiplier={saved!r}, instead of target_epsilon" in str(err.value)
    longer = build(noise_multiplier=saved, epochs=3, max_epsilon=10.0)
    longer.load_state_dict(state)  # the advice works
    assert longer.accountant.steps == first.accountant.steps
    assert longer.epsilon() == first.epsilon()


def test_search_planned_without_y_needs_no_labels() -> None:
    """`search.planned_mechanism(X)` (the cost before fitting, as an estimator's takes X
    alone) plans a classifier's search without its labels (no plan reads them); fitting
    without y is refused, naming fit(X, y) and the planning call."""
    from privlearn.models import PrivateSearchCV

    X = np.random.default_rng(0).random((50, 2))
    y = np.array([0, 1] * 25)
    search = PrivateSearchCV(
        DPSGDClassifier(delta=1e-6, n_iter=5, classes=[0, 1]), {"epsilon": [0.5, 1.0]}
    )
    assert search.planned_mechanism(X) == search.planned_mechanism(X, y)
    with pytest.raises(ParameterValueError) as err:
        search.fit(X, None)
    assert "got y=None" in str(err.value) and "fit(X, y)" in str(err.value)
    assert "planned_mechanism(X)" in str(err.value)


def test_cli_help_writes_every_default_one_way() -> None:
    """Every `--help` of the command line states a default as "(default: X)", as click's
    own "[default: X]" does, never "(default X)"."""
    import re

    commands = [
        ["epsilon"],
        ["calibrate"],
        ["demo"],
        ["reproduce"],
        ["audit", "dpsgd"],
        *[["budget", c] for c in ("init", "spend", "show", "history", "verify")],
    ]
    for command in commands:
        out = CliRunner().invoke(cli, [*command, "--help"]).output
        text = " ".join(out.split())
        assert not re.search(r"\(default [^:]", text), (command, text)


def test_ledger_path_with_tilde_says_python_does_not_expand_it(tmp_path, monkeypatch) -> None:
    """`Ledger("~/privacy.db", create=True)`, as a path is written in the shell: Python
    does not expand '~', so the refusal (no folder named '~' here) says so and gives the
    expanded path, which works."""
    import os

    from privlearn.errors import LedgerNotFoundError
    from privlearn.ledger import Ledger

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LedgerNotFoundError) as err:
        Ledger("~/privacy.db", create=True)
    expanded = os.path.join(str(tmp_path), "privacy.db")
    assert "os.path.expanduser('~/privacy.db')" in str(err.value)
    assert repr(expanded) in str(err.value)
    Ledger(os.path.expanduser("~/privacy.db"), create=True).create_budget("d", 1.0, 1e-6)
    assert os.path.isfile(expanded)


def test_cli_budget_spend_takes_a_run_by_batch_size_and_epochs(tmp_path) -> None:
    """A run checked with `privlearn epsilon --batch-size B --dataset-size N --epochs E` is
    recorded with the same options: the same mechanism as its rate B/N and its
    E * round(N/B) steps written out (here 10 * round(60000/256) = 10 * 234)."""
    import json

    db = str(tmp_path / "privacy.db")
    init = ["budget", "init", db, "--dataset", "d", "--epsilon", "5", "--delta", "1e-6"]
    assert CliRunner().invoke(cli, init).exit_code == 0
    spend = ["budget", "spend", db, "--dataset", "d", "--noise-multiplier", "1.0"]
    r = CliRunner().invoke(
        cli, [*spend, "--batch-size", "256", "--dataset-size", "60000", "--epochs", "10"]
    )
    assert r.exit_code == 0, r.output
    assert "steps = 10 epochs x 234 steps per epoch" in r.output
    r = CliRunner().invoke(cli, [*spend, "--sampling-rate", repr(256 / 60000), "--steps", "2340"])
    assert r.exit_code == 0, r.output
    history = json.loads(CliRunner().invoke(cli, ["budget", "history", db, "--json"]).output)
    by_epochs, by_rate = (e["mechanism"] for e in history if e["kind"] == "spend")
    assert by_epochs == by_rate
    help_text = CliRunner().invoke(cli, ["budget", "spend", "--help"]).output
    assert "--batch-size" in help_text and "--epochs" in help_text
    assert "for budget spend the budget's delta" in " ".join(help_text.split())


def test_rdp_only_mechanism_under_the_default_accountant_says_use_rdp() -> None:
    """A private search's planned cost is a mechanism known by its Renyi-DP curve:
    `.epsilon(delta)` (the default 'pld' accountant) is refused, and the refusal leads
    with accountant='rdp' (not with registering a new PLD function), which works: for a
    Gaussian's curve alpha / (2 sigma^2) its epsilon is at most the classic conversion
    min over alpha of rdp(alpha) + log(1/delta) / (alpha - 1) (Mironov 2017,
    Proposition 3), which the improved conversion only tightens."""
    import math

    from privlearn.accounting import RDPMechanism, UnsupportedMechanismError

    sigma = 2.0
    m = RDPMechanism(lambda a: a / (2 * sigma**2))
    with pytest.raises(UnsupportedMechanismError) as err:
        m.epsilon(1e-5)
    message = str(err.value)
    assert "pass accountant='rdp'" in message
    assert message.index("accountant='rdp'") < message.index("register")
    eps = m.epsilon(1e-5, accountant="rdp")
    classic = min(
        a / (2 * sigma**2) + math.log(1 / 1e-5) / (a - 1) for a in np.linspace(1.01, 200, 20000)
    )
    assert 0 < eps <= classic + 1e-9


@pytest.mark.parametrize(
    "command",
    [
        ["epsilon", "--noise-multiplier", "1.0"],
        ["calibrate", "--target-epsilon", "2"],
    ],
)
def test_cli_help_names_every_json_field(command) -> None:
    """`epsilon --help` and `calibrate --help` name the fields their --json object has."""
    import json

    run = ["--sampling-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--json"]
    printed = json.loads(CliRunner().invoke(cli, [*command, *run]).output)
    help_text = " ".join(CliRunner().invoke(cli, [command[0], "--help"]).output.split())
    described = help_text.split("With --json:", 1)
    assert len(described) == 2, help_text
    given = ("mechanism", "sampling_rate", "sampling", "steps")  # the mechanism's parameters
    if "--noise-multiplier" in command:
        given += ("noise_multiplier",)
    fields = [k for k in printed if k not in given]
    for key in fields:
        assert key in described[1], (key, described[1])
    assert "the mechanism's parameters" in described[1]


def test_large_default_delta_warning_says_it_is_the_default() -> None:
    """On 200,000 records the defaults' delta (1e-5) is above 1/n: the warning says the
    value is the default, so whoever never set delta knows which setting it is about; an
    explicit delta is not called the default."""
    from privlearn.errors import PrivacyLeakWarning

    rng = np.random.default_rng(0)
    X, y = rng.random((200_000, 2)), np.array([0, 1] * 100_000)
    with pytest.warns(PrivacyLeakWarning, match=r"delta=1e-05 \(the default\) is at least"):
        DPSGDClassifier(classes=[0, 1], n_iter=1, random_state=0).fit(X, y)
    with pytest.warns(PrivacyLeakWarning) as record:
        DPSGDClassifier(classes=[0, 1], n_iter=1, delta=2e-5, random_state=0).fit(X, y)
    assert all("(the default)" not in str(w.message) for w in record)


def test_large_default_target_delta_warning_says_it_is_the_default() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.errors import PrivacyLeakWarning
    from privlearn.torch import make_private

    model = torch.nn.Linear(2, 2)
    loader = DataLoader(
        TensorDataset(torch.zeros(200_000, 2), torch.zeros(200_000, dtype=torch.long)),
        batch_size=1000,
    )
    with pytest.warns(PrivacyLeakWarning, match=r"target_delta=1e-05 \(the default\)"):
        make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0
        )


def test_cli_epsilon_says_which_neighbouring_relation_it_holds_under() -> None:
    """`--sampling fixed` gives a much larger epsilon than Poisson at the same noise, which
    looks like a mistake unless the output says why: it names the relation. What it says
    is checked on the whole dataset (rate 1), where a replace-one step of noise
    multiplier 1 is a Gaussian of noise multiplier 1/2 under add/remove (twice the
    sensitivity), computed by the analytic Gaussian accountant."""
    import json

    base = ["epsilon", "--noise-multiplier", "1.0", "--delta", "1e-5"]
    poisson = CliRunner().invoke(cli, [*base, "--sampling-rate", "0.01", "--steps", "100"])
    assert "neighbouring: add_remove" in poisson.output, poisson.output
    fixed = CliRunner().invoke(
        cli, [*base, "--sampling-rate", "0.01", "--steps", "100", "--sampling", "fixed"]
    )
    assert "neighbouring: replace_one" in fixed.output, fixed.output
    assert "twice the sensitivity" in fixed.output
    whole = CliRunner().invoke(
        cli, [*base, "--sampling-rate", "1", "--sampling", "fixed", "--json"]
    )
    doubled = Gaussian(0.5).epsilon(1e-5, accountant="analytic")
    assert json.loads(whole.output)["epsilon"] == pytest.approx(doubled, rel=1e-3)
    cal = CliRunner().invoke(
        cli,
        [
            "calibrate",
            "--target-epsilon",
            "2",
            "--delta",
            "1e-5",
            "--sampling-rate",
            "0.01",
            "--steps",
            "100",
            "--sampling",
            "fixed",
        ],
    )
    assert "neighbouring: replace_one" in cal.output, cal.output
