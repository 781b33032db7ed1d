"""The correlated-noise study's language-model task: the Adult records as token sequences
(checked record by record against the raw attributes), its small configuration end to end
(files, the non-private reference, the plans), and its settings refused at the boundary."""

import csv
import math
import re

import numpy as np
import pytest

from privlearn.datasets import ADULT_COLUMNS, _adult_categories, load_adult
from privlearn.experiments import run_experiment
from privlearn.experiments._adult_tokens import NUMERIC_EDGES, adult_vocabulary


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _in_bucket(name: str, value: float) -> bool:
    """Whether ``value`` lies in the bucket named ``name`` ("<25", "25-29", ">=70")."""
    if name.startswith("<"):
        return value < float(name[1:])
    if name.startswith(">="):
        return value >= float(name[2:])
    lo, hi = map(float, re.fullmatch(r"(\d+)-(\d+)", name).groups())
    return lo <= value <= hi  # integer attributes: the edges are integers


def test_vocabulary_is_the_public_schema():
    """One token per category of adult.names and per bucket, every name unique, no record
    read (the same vocabulary whatever the data)."""
    vocab = adult_vocabulary()
    cats = _adult_categories()
    assert len(set(vocab.tokens)) == vocab.size
    expected = 2 + sum(1 + len(cats[a]) for a in vocab.attributes if a in cats) + sum(
        2 + len(NUMERIC_EDGES[a]) for a in vocab.attributes if a in NUMERIC_EDGES)
    assert vocab.size == expected
    assert vocab.length == 13 and "fnlwgt" not in vocab.attributes
    assert "education-num" not in vocab.attributes


@pytest.mark.parametrize("split", ["train", "test"])
def test_encoding_names_each_records_values(split):
    """Decoding every token of every record gives back its attribute values (categories
    exactly, numbers inside the bucket named), in the vocabulary's order."""
    vocab = adult_vocabulary()
    raw = load_adult(split, features="raw").data
    ids = vocab.encode(raw)
    assert ids.shape == (len(raw), 13) and ids.dtype == np.int64
    assert np.all(ids[:, 0] == 1)
    rng = np.random.default_rng(0)
    for i in rng.choice(len(raw), size=300, replace=False):
        for k, attr in enumerate(vocab.attributes, start=1):
            name, _, value = vocab.tokens[ids[i, k]].partition("=")
            assert name == attr
            raw_value = raw[i, ADULT_COLUMNS.index(attr)]
            if attr in NUMERIC_EDGES:
                assert _in_bucket(value, float(raw_value)), (attr, raw_value, value)
            else:
                assert value == raw_value
    # complete records: every value is in the published lists (no [UNK])
    assert not any(t.endswith("[UNK]") for t in np.asarray(vocab.tokens)[ids[:, 1:]].ravel())


def test_unknown_category_and_bad_shape():
    vocab = adult_vocabulary()
    raw = load_adult("train", features="raw").data[:2].copy()
    raw[0, ADULT_COLUMNS.index("workclass")] = "?"
    ids = vocab.encode(raw)
    assert vocab.tokens[ids[0, 2]] == "workclass=[UNK]"
    assert vocab.tokens[ids[1, 2]] != "workclass=[UNK]"
    with pytest.raises(ValueError, match=r"shape \(n, 14\)"):
        vocab.encode(raw[:, :5])


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("adult_bert")
    return run_experiment("correlated-noise-adult-bert", out, quick=True, plot=False)


def test_quick_row_writes_its_tables_and_reference(quick):
    from privlearn.experiments.correlated_noise import QUICK_ADULT_BERT as Q
    from privlearn.experiments.correlated_noise import STRATEGIES

    assert [r["method"] for r in quick.rows] == [s.name for s in STRATEGIES]
    runs = _rows(quick.paths[1])
    assert len(runs) == (len(STRATEGIES) + 1) * (len(Q.learning_rates) + 1)
    ref = [r for r in runs if r["method"] == "non-private"]
    assert [r["phase"] for r in ref] == ["reference-tuning"] * len(Q.learning_rates) + [
        "reference-final"]
    assert all(r["epsilon_spent"] == "inf" for r in ref)
    summary = quick.summary
    assert summary["nonprivate"]["median_accuracy"] == pytest.approx(
        float(ref[-1]["accuracy"]))
    assert 0 < summary["cpu_seconds"] and 0 < summary["wall_seconds"]
    text = quick.paths[2].read_text()
    assert "Non-private reference" in text and "Cost of the whole run" in text
    steps = Q.epochs * math.ceil(Q.n_train / Q.batch_size)
    for r in quick.rows:
        assert r["steps"] == steps
        assert 0.9 * r["epsilon"] < r["epsilon_spent"] <= r["epsilon"]
        # a label of the 500 test records: accuracy is a multiple of 1/500
        assert 0 <= r["median_accuracy"] <= 1
        assert r["median_accuracy"] * 500 == pytest.approx(round(r["median_accuracy"] * 500))


def test_bert_task_trains_every_parameter_privately():
    """One private step of the BERT classifier moves every parameter (the engine covers
    the embeddings, attention, layer norms, pooler and head) and is accounted."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from privlearn.experiments import _correlated_torch as ct

    vocab = adult_vocabulary()
    split = ct.adult_split(100, 0, n_train=200, n_test=50)
    model = dict(task="adult-bert", hidden=32, layers=1, vocab_size=vocab.size,
                 length=vocab.length)
    net = ct.build_model(**model)
    assert type(net.bert).__name__ == "BertForSequenceClassification"
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    from torch.utils.data import DataLoader, TensorDataset

    from privlearn.torch import make_private

    p = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                     DataLoader(TensorDataset(split.x_train, split.y_train), batch_size=20),
                     noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    xb, yb = next(iter(p.data_loader))
    torch.nn.functional.cross_entropy(p.model(xb), yb).backward()
    p.optimizer.step()
    moved = [n for n, q in net.named_parameters() if not torch.equal(q, before[n])]
    assert len(moved) == len(before)
    assert p.epsilon(1e-5) > 0


def test_bad_settings_are_refused(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="task must be one of"):
        run_experiment("correlated-noise", out, task="imdb")
    with pytest.raises(ValueError, match="optimizer must be 'sgd' or 'adam'"):
        run_experiment("correlated-noise-adult-bert", out, optimizer="rmsprop")
    with pytest.raises(ValueError, match="task is 'adult-bert'"):
        run_experiment("correlated-noise-adult-bert", out, task="mnist")
    with pytest.raises(ValueError, match="layers"):
        run_experiment("correlated-noise-adult-bert", out, layers=0)
    assert not out.exists()
