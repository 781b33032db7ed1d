"""Dataset loaders: bundled copies equal the reference matrices; seed 000 numbers."""

import gzip
from pathlib import Path

import numpy as np
import pytest

from privlearn.datasets import (
    load_adult,
    load_california_housing,
    load_mnist,
    make_logistic_data,
    preprocess_california_housing,
)


def _sklearn_cache(joblib, data_home: Path) -> None:
    """Write the bundled raw file into ``data_home`` as scikit-learn's fetcher caches it
    (PROVENANCE recipe), so that ``fetch_california_housing`` runs offline."""
    src = Path(__file__).resolve().parents[1] / "privlearn" / "data" / "cal_housing.data.gz"
    with gzip.open(src) as f:
        raw = np.loadtxt(f, delimiter=",")
    joblib.dump(raw[:, [8, 7, 2, 3, 4, 5, 6, 1, 0]], data_home / "cal_housing_py3.pkz",
                compress=6)


def test_california_equals_sklearn_fetcher(tmp_path):
    """scikit-learn's own loader, fed the raw file offline (PROVENANCE recipe)."""
    joblib = pytest.importorskip("joblib")
    from sklearn.datasets import fetch_california_housing

    _sklearn_cache(joblib, tmp_path)
    ref = fetch_california_housing(data_home=str(tmp_path), download_if_missing=False)
    ours = load_california_housing()
    assert ours.data.shape == (20640, 8)
    np.testing.assert_array_equal(ours.data, ref.data)
    np.testing.assert_array_equal(ours.target, ref.target)
    assert ours.feature_names == list(ref.feature_names)


def test_california_as_frame_as_the_sklearn_fetcher(tmp_path):
    """as_frame=True returns what fetch_california_housing(as_frame=True) returns: the
    same DataFrame, Series and frame (column names and dtypes included)."""
    pd = pytest.importorskip("pandas")
    joblib = pytest.importorskip("joblib")
    from sklearn.datasets import fetch_california_housing

    _sklearn_cache(joblib, tmp_path)
    ref = fetch_california_housing(data_home=str(tmp_path), download_if_missing=False,
                                   as_frame=True)
    ours = load_california_housing(as_frame=True)
    pd.testing.assert_frame_equal(ours.data, ref.data)
    pd.testing.assert_series_equal(ours.target, ref.target)
    pd.testing.assert_frame_equal(ours.frame, ref.frame)
    bounded = load_california_housing(preprocessing="bounded", as_frame=True)
    np.testing.assert_array_equal(bounded.data.to_numpy(),
                                  load_california_housing(preprocessing="bounded").data)
    with pytest.raises(ValueError, match="as_frame must be True or False"):
        load_california_housing(as_frame="yes")


def test_california_seed000_baselines():
    b = load_california_housing(preprocessing="bounded")
    X, y = b.data, b.target
    np.testing.assert_allclose(np.linalg.norm(X, axis=1), 1.0, rtol=1e-12)
    assert y.min() >= 0 and y.max() <= 5
    theta = np.linalg.solve(X.T @ X, X.T @ y)
    assert np.linalg.norm(y - X @ theta) ** 2 / len(y) == pytest.approx(0.6053084771039058,
                                                                       rel=1e-12)
    assert np.linalg.norm(y - y.mean()) ** 2 / len(y) == pytest.approx(1.331547558951559,
                                                                       rel=1e-12)
    raw = load_california_housing()
    X2, y2 = preprocess_california_housing(raw.data, raw.target)
    np.testing.assert_array_equal(X2, X)
    with pytest.raises(ValueError, match="preprocessing"):
        load_california_housing(preprocessing="standardise")


def test_adult_counts_and_features():
    tr, te = load_adult("train"), load_adult("test")
    assert tr.data.shape[0] == 30162 and te.data.shape[0] == 15060
    assert tr.data.shape[1] == te.data.shape[1] == len(tr.feature_names)
    raw = load_adult("train", features="raw", drop_missing=False)
    assert raw.data.shape == (32561, 14)
    assert int(raw.target.sum()) == 7841
    assert int(load_adult("test", features="raw", drop_missing=False).target.sum()) == 3846
    # each complete record has exactly one category per categorical attribute (8 of them)
    onehot = tr.data[:, 5:]
    np.testing.assert_array_equal(onehot.sum(axis=1), 8)
    clipped = load_adult("train", row_norm=1.0)
    assert np.linalg.norm(clipped.data, axis=1).max() <= 1.0 + 1e-12
    with pytest.raises(ValueError, match="split"):
        load_adult("validation")


def test_mnist_shapes_and_label_counts():
    try:
        tr = load_mnist("train")
    except FileNotFoundError:
        pytest.skip("MNIST files not available offline")
    te = load_mnist("test")
    assert tr.data.shape == (60000, 28, 28) and tr.data.dtype == np.uint8
    assert tr.target.dtype == np.int64 and te.data.shape == (10000, 28, 28)
    np.testing.assert_array_equal(
        np.bincount(tr.target), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    )
    np.testing.assert_array_equal(
        np.bincount(te.target), [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    )


def test_mnist_missing_directory_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="download=True"):
        load_mnist("train", data_home=tmp_path)
    with pytest.raises(ValueError, match="split"):
        load_mnist("valid")


def test_make_logistic_data():
    d = make_logistic_data(500, 300, 6, random_state=0)
    assert d.X_train.shape == (500, 6) and d.X_test.shape == (300, 6)
    np.testing.assert_array_equal(d.X_train[:, 0], 1.0)
    assert np.abs(d.X_train[:, 1:]).max() <= 0.5
    assert set(np.unique(d.y_train)) <= {0, 1}
    # labels follow the logistic model: the Bayes rule beats chance clearly
    d = make_logistic_data(20000, 0, 6, random_state=1)
    p = 1 / (1 + np.exp(-(d.X_train @ d.theta_true)))
    assert abs(np.mean(d.y_train) - np.mean(p)) < 0.02


def _fake_mnist(directory: Path) -> None:
    """Tiny valid IDX files (3 images) under the canonical MNIST names."""
    directory.mkdir(parents=True, exist_ok=True)
    imgs = (0x00000803).to_bytes(4, "big") + b"".join(
        d.to_bytes(4, "big") for d in (3, 28, 28)) + bytes(3 * 28 * 28)
    lbls = (0x00000801).to_bytes(4, "big") + (3).to_bytes(4, "big") + bytes([1, 2, 3])
    for split in ("train", "t10k"):
        with gzip.open(directory / f"{split}-images-idx3-ubyte.gz", "wb") as f:
            f.write(imgs)
        with gzip.open(directory / f"{split}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(lbls)


def test_mnist_search_documented_places_only(tmp_path, monkeypatch):
    """data_home, then $PRIVLEARN_DATA, then the user cache; never the parents of the
    current directory (the old search walked them)."""
    from privlearn.datasets import DataNotFoundError

    monkeypatch.delenv("PRIVLEARN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # MNIST under <parent>/shared/data/mnist of the working directory is NOT found
    _fake_mnist(tmp_path / "shared" / "data" / "mnist")
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    with pytest.raises(DataNotFoundError) as err:
        load_mnist("train")
    msg = str(err.value)
    assert "\n" not in msg and "PRIVLEARN_DATA" in msg and "download=True" in msg
    assert str(tmp_path / "cache" / "privlearn" / "mnist") in msg
    assert "shared" not in msg
    # the environment variable
    monkeypatch.setenv("PRIVLEARN_DATA", str(tmp_path / "shared" / "data"))
    b = load_mnist("test")
    assert b.data.shape == (3, 28, 28) and list(b.target) == [1, 2, 3]
    assert b.path == str(tmp_path / "shared" / "data" / "mnist")
    # the user cache
    monkeypatch.delenv("PRIVLEARN_DATA")
    _fake_mnist(tmp_path / "cache" / "privlearn" / "mnist")
    assert load_mnist("train").path == str(tmp_path / "cache" / "privlearn" / "mnist")
    # an explicit data_home wins and is the only place searched
    with pytest.raises(DataNotFoundError):
        load_mnist("train", data_home=tmp_path / "elsewhere")
    assert load_mnist("train", data_home=tmp_path / "shared" / "data").data.shape[0] == 3


def test_bunch_without_sklearn():
    import subprocess
    import sys

    code = ("import sys; from privlearn.datasets import load_california_housing as f; "
            "b = f(preprocessing='bounded'); assert b.data is b['data']; "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_bounded_preprocessing():
    a = load_california_housing(preprocessing="bounded")
    np.testing.assert_allclose(np.linalg.norm(a.data, axis=1), 1.0)
    assert a.target.max() <= 5.0


def test_former_preprocessing_name_is_deprecated_not_silent():
    from privlearn.datasets import load_california_housing

    with pytest.warns(FutureWarning, match="preprocessing='bounded'"):
        old = load_california_housing(preprocessing="seed")
    new = load_california_housing(preprocessing="bounded")
    np.testing.assert_array_equal(old.data, new.data)
    np.testing.assert_array_equal(old.target, new.target)
