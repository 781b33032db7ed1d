"""Dataset loaders used by the experiments.

Offline by default: California housing and UCI Adult are bundled with the package
(``privlearn/data``, with their provenance files). MNIST (11 MB) is not bundled; it is
looked for in these places only, in this order:

1. the directory passed as ``data_home`` (or its ``mnist/`` subdirectory), if given;
   otherwise
2. ``$PRIVLEARN_DATA/mnist`` (or ``$PRIVLEARN_DATA`` itself), if the environment variable
   ``PRIVLEARN_DATA`` is set;
3. the user cache, ``$XDG_CACHE_HOME/privlearn/mnist`` (default
   ``~/.cache/privlearn/mnist``).

It is downloaded (checksums verified) only when ``download=True``, into ``data_home`` if
given, else the user cache.

Every loader returns a :class:`Bunch` (a dictionary whose keys are also attributes, like
scikit-learn's) with ``data``, ``target`` and a ``DESCR`` string. The module does not import
scikit-learn, so loading a dataset stays fast.

Length: three loaders (California housing, Adult, MNIST) with their download paths,
checksums and documented search order; each is short.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import urllib.request
import warnings
from pathlib import Path

import numpy as np

from privlearn.errors import DataFormatError, DataNotFoundError, ParameterValueError

__all__ = [
    "Bunch",
    "DataNotFoundError",
    "load_california_housing",
    "preprocess_california_housing",
    "load_adult",
    "load_mnist",
    "make_logistic_data",
    "CALIFORNIA_FEATURE_NAMES",
    "CALIFORNIA_FEATURE_SCALES",
]

_DATA_DIR = Path(__file__).resolve().parent / "data"

#: Environment variable naming a data directory (MNIST is read from ``$PRIVLEARN_DATA/mnist``).
DATA_ENV = "PRIVLEARN_DATA"


class Bunch(dict):
    """A dictionary whose keys are also attributes (``b.data`` is ``b["data"]``), the
    container scikit-learn's dataset fetchers return."""

    def __getattr__(self, key: str):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value) -> None:
        self[key] = value

    def __dir__(self):
        return list(self.keys())


# ---------------------------------------------------------------------------------------
# California housing
# ---------------------------------------------------------------------------------------

CALIFORNIA_FEATURE_NAMES = [
    "MedInc",
    "HouseAge",
    "AveRooms",
    "AveBedrms",
    "Population",
    "AveOccup",
    "Latitude",
    "Longitude",
]

#: Fixed, data-independent rescaling of the eight features ("natural ranges") used by the
#: SSP/AdaSSP/NoisyGD linear-regression study.
CALIFORNIA_FEATURE_SCALES = np.array([10.0, 50.0, 100.0, 40.0, 40000.0, 1000.0, 50.0, 100.0])

_PREPROCESSINGS = (None, "bounded")
#: Former names of preprocessings: accepted with a FutureWarning, removed in 0.3.
_FORMER_PREPROCESSINGS = {"seed": "bounded"}

_CAL_SHA256_GZ = "9ec0c7920a28267aa6fd23b11fab174e134d9dff83e17c1d19674a7650834755"


def _read_gz(path: Path) -> bytes:
    with gzip.open(path, "rb") as f:
        return f.read()


def load_california_housing(
    *,
    preprocessing: str | None = None,
    x_bound: float = 1.0,
    y_bound: float = 5.0,
    as_frame: bool = False,
) -> Bunch:
    """California housing (Pace & Barry 1997), the matrix of scikit-learn's fetcher.

    Read from the bundled StatLib file ``cal_housing.data.gz`` and re-derived exactly as
    ``sklearn.datasets.fetch_california_housing`` does (same column order, same ratios,
    target in units of $100,000), so no download is needed.

    Parameters
    ----------
    preprocessing : {None, "bounded"}
        ``None``: the raw 20640 x 8 matrix. ``"bounded"``: the bounded preprocessing of
        the linear-regression study (every row of norm ``x_bound``, labels in
        ``[0, y_bound]``), see :func:`preprocess_california_housing`.

        .. deprecated:: 0.2
           ``"seed"``, the former name of ``"bounded"``, warns (``FutureWarning``) and
           will be removed in 0.3.
    x_bound, y_bound : float
        Bounds used by the bounded preprocessing (ignored otherwise).
    as_frame : bool
        As scikit-learn's ``fetch_california_housing(as_frame=True)``: ``data`` a pandas
        ``DataFrame`` with the feature names as columns, ``target`` a ``Series`` named
        ``MedHouseVal``, and ``frame`` both in one ``DataFrame`` (needs pandas).

    Returns
    -------
    Bunch
        ``data`` (20640, 8) float64, ``target`` (20640,) float64, ``feature_names``,
        ``target_names``, ``DESCR``; with ``as_frame=True`` also ``frame``, and ``data``
        and ``target`` as pandas objects.
    """
    if not isinstance(as_frame, bool | np.bool_):
        raise ParameterValueError(f"as_frame must be True or False, got {as_frame!r}")
    if preprocessing in _FORMER_PREPROCESSINGS:
        new = _FORMER_PREPROCESSINGS[preprocessing]
        warnings.warn(f"preprocessing={preprocessing!r} is deprecated and will be removed "
                      f"in privlearn 0.3; pass preprocessing={new!r} (the same "
                      "preprocessing)", FutureWarning, stacklevel=2)
        preprocessing = new
    if preprocessing not in _PREPROCESSINGS:
        raise ParameterValueError(
            f"preprocessing must be None or 'bounded', got {preprocessing!r}"
        )
    raw_bytes = _read_gz(_DATA_DIR / "cal_housing.data.gz")
    raw = np.array(raw_bytes.decode("ascii").replace("\n", ",").split(","), dtype=float)
    raw = raw.reshape(-1, 9)
    # Same derivation as sklearn/datasets/_california_housing.py (scikit-learn 1.9.1).
    cal = raw[:, [8, 7, 2, 3, 4, 5, 6, 1, 0]]
    target, data = cal[:, 0].copy(), cal[:, 1:].copy()
    data[:, 2] /= data[:, 5]
    data[:, 3] /= data[:, 5]
    data[:, 5] = data[:, 4] / data[:, 5]
    target = target / 100000.0
    descr = (
        "California housing (StatLib cal_housing.data, Pace & Barry 1997), derived as "
        "scikit-learn's fetch_california_housing. See privlearn/data/"
        "PROVENANCE_california_housing.md."
    )
    if preprocessing == "bounded":
        data, target = preprocess_california_housing(data, target, x_bound, y_bound)
        descr += " Bounded preprocessing applied (fixed rescaling, rows normalised, "
        descr += "labels clipped)."
    out = Bunch(
        data=data,
        target=target,
        feature_names=list(CALIFORNIA_FEATURE_NAMES),
        target_names=["MedHouseVal"],
        DESCR=descr,
    )
    if as_frame:
        _as_frame(out)
    return out


def _as_frame(bunch: Bunch) -> None:
    """``bunch``'s ``data`` and ``target`` as a pandas ``DataFrame`` and ``Series``, and
    ``frame`` with both, as scikit-learn's fetchers return with ``as_frame=True``."""
    try:
        import pandas as pd
    except ImportError as e:
        raise ImportError(
            "as_frame=True needs pandas, which is not installed; install it (pip install "
            "pandas) or pass as_frame=False for NumPy arrays") from e
    data = pd.DataFrame(bunch.data, columns=bunch.feature_names)
    target = pd.Series(bunch.target, name=bunch.target_names[0])
    bunch.update(data=data, target=target, frame=pd.concat([data, target], axis=1))


def preprocess_california_housing(
    data: np.ndarray, target: np.ndarray, x_bound: float = 1.0, y_bound: float = 5.0
) -> tuple[np.ndarray, np.ndarray]:
    """The linear-regression study's data-independent preprocessing.

    Features are divided by the fixed "natural ranges" ``CALIFORNIA_FEATURE_SCALES``, each
    row is L2-normalised and multiplied by ``x_bound`` (so every row has norm exactly
    ``x_bound``), and the labels are clipped to ``[0, y_bound]``. Nothing is estimated
    from the data, so the preprocessing costs no privacy.

    Parameters
    ----------
    data : ndarray of shape (n, 8)
        The raw California housing features.
    target : ndarray of shape (n,)
        The raw targets (units of $100,000).
    x_bound, y_bound : float
        Row norm and label bound.

    Returns
    -------
    X, y : ndarray
        The preprocessed features and labels.
    """
    X = np.asarray(data, dtype=float) / CALIFORNIA_FEATURE_SCALES
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    norms[norms == 0] = 1.0  # sklearn.preprocessing.normalize leaves zero rows unchanged
    X = x_bound * (X / norms)
    y = np.clip(np.asarray(target, dtype=float), 0.0, y_bound)
    return X, y


# ---------------------------------------------------------------------------------------
# Adult
# ---------------------------------------------------------------------------------------

ADULT_COLUMNS = [
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
    "income",
]

#: Data-independent transforms of the numeric Adult columns: ``f(x)`` maps the column's
#: public range into roughly [0, 1]. Nothing is estimated from the data, so the
#: preprocessing costs no privacy.
_ADULT_NUMERIC = {
    "age": lambda x: x / 100.0,
    "education-num": lambda x: x / 16.0,
    "capital-gain": lambda x: np.log1p(x) / np.log1p(100000.0),
    "capital-loss": lambda x: np.log1p(x) / np.log1p(5000.0),
    "hours-per-week": lambda x: x / 100.0,
}


def _adult_categories() -> dict[str, list[str]]:
    """Category lists for the discrete Adult attributes, read from ``adult.names``
    (public metadata, not the records)."""
    text = _read_gz(_DATA_DIR / "adult.names.gz").decode("latin-1")
    cats: dict[str, list[str]] = {}
    for line in text.splitlines():
        if ":" not in line or line.startswith("|"):
            continue
        name, _, rest = line.partition(":")
        name = name.strip()
        if name in ADULT_COLUMNS and "continuous" not in rest:
            cats[name] = [c.strip().rstrip(".") for c in rest.split(",") if c.strip()]
    return cats


def _read_adult_rows(split: str) -> list[list[str]]:
    fname = {"train": "adult.data.gz", "test": "adult.test.gz"}[split]
    text = _read_gz(_DATA_DIR / fname).decode("latin-1")
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("|"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 15:
            continue
        fields[-1] = fields[-1].rstrip(".")
        rows.append(fields)
    return rows


def load_adult(
    split: str = "train",
    *,
    features: str = "onehot",
    drop_missing: bool = True,
    row_norm: float | None = None,
) -> Bunch:
    """UCI Adult census income (Becker & Kohavi 1996), from the bundled original files.

    Parameters
    ----------
    split : {"train", "test"}
        ``adult.data`` (32,561 records) or ``adult.test`` (16,281 records).
    features : {"onehot", "numeric", "raw"}
        ``"onehot"`` (default): the five numeric columns (age, education-num,
        capital-gain, capital-loss, hours-per-week) under fixed, data-independent
        transforms (``age/100``, ``education-num/16``, ``log1p(gain)/log1p(1e5)``,
        ``log1p(loss)/log1p(5000)``, ``hours/100``) followed by one-hot encodings of the
        eight categorical columns with the category lists of ``adult.names`` (fnlwgt, a
        sampling weight, is dropped). ``"numeric"``: only the five transformed numeric
        columns. ``"raw"``: an object array of the 14 original attributes as strings.
        Because no statistic of the records is used, the preprocessing costs no privacy.
    drop_missing : bool
        Drop records with a missing (``?``) attribute (default, leaving 30,162 / 15,060).
        When False a missing categorical value encodes as all zeros.
    row_norm : float, optional
        If given, rows with L2 norm above ``row_norm`` are scaled down to it.

    Returns
    -------
    Bunch
        ``data``, ``target`` (int64, 1 for income >50K), ``feature_names``, ``DESCR``.
    """
    if split not in ("train", "test"):
        raise ParameterValueError(f"split must be 'train' or 'test', got {split!r}")
    if features not in ("onehot", "numeric", "raw"):
        raise ParameterValueError(
            f"features must be 'onehot', 'numeric' or 'raw', got {features!r}")
    rows = _read_adult_rows(split)
    if drop_missing:
        rows = [r for r in rows if "?" not in r]
    arr = np.array(rows, dtype=object)
    target = (arr[:, -1] == ">50K").astype(np.int64)
    attrs = arr[:, :-1]
    descr = "UCI Adult (census income); see privlearn/data/PROVENANCE_adult.md."
    if features == "raw":
        return Bunch(data=attrs, target=target, feature_names=ADULT_COLUMNS[:-1], DESCR=descr)
    cols = []
    names = []
    for name, f in _ADULT_NUMERIC.items():
        j = ADULT_COLUMNS.index(name)
        cols.append(f(attrs[:, j].astype(float))[:, None])
        names.append(name)
    if features == "onehot":
        for name, cats in _adult_categories().items():
            j = ADULT_COLUMNS.index(name)
            col = attrs[:, j]
            onehot = (col[:, None] == np.array(cats, dtype=object)[None, :]).astype(float)
            cols.append(onehot)
            names.extend(f"{name}={c}" for c in cats)
    X = np.hstack(cols)
    if row_norm is not None:
        if not row_norm > 0:
            raise ParameterValueError(f"row_norm must be > 0, got {row_norm!r}")
        norms = np.linalg.norm(X, axis=1, keepdims=True)
        X = X * np.minimum(1.0, row_norm / np.maximum(norms, 1e-300))
    return Bunch(data=X, target=target, feature_names=names, DESCR=descr)


# ---------------------------------------------------------------------------------------
# MNIST
# ---------------------------------------------------------------------------------------

_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
#: md5 of the decompressed canonical MNIST files.
_MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte.gz": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte.gz": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte.gz": "27ae3e4e09519cfbb04c329615203637",
}
_MNIST_MIRRORS = [
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
]


def _mnist_candidate_dirs(data_home: str | os.PathLike | None) -> list[Path]:
    """The documented places, in order: ``data_home`` (and ``data_home/mnist``) if given,
    else ``$PRIVLEARN_DATA/mnist`` and ``$PRIVLEARN_DATA``, then the user cache. Never the
    current directory or its parents."""
    if data_home is not None:
        base = Path(data_home).expanduser()
        return [base, base / "mnist"]
    dirs = []
    env = os.environ.get(DATA_ENV)
    if env:
        dirs += [Path(env).expanduser() / "mnist", Path(env).expanduser()]
    dirs.append(_cache_dir() / "mnist")
    return dirs


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    return Path(root) / "privlearn"


def _parse_idx(raw: bytes, expected_magic: int) -> np.ndarray:
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected_magic:
        raise DataFormatError(
            f"not an IDX file with magic {expected_magic:#x} (got {magic:#x})")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataFormatError(f"IDX file truncated: expected {int(np.prod(dims))} bytes")
    return data.reshape(dims)


def _download_mnist(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for fname, md5 in _MNIST_MD5.items():
        target = dest / fname
        if target.exists():
            continue
        last_err: Exception | None = None
        for mirror in _MNIST_MIRRORS:
            try:
                tmp = target.with_suffix(".part")
                with urllib.request.urlopen(mirror + fname, timeout=60) as r, open(tmp, "wb") as f:
                    shutil.copyfileobj(r, f)
                if hashlib.md5(_read_gz(tmp)).hexdigest() != md5:
                    tmp.unlink()
                    raise OSError(f"checksum mismatch for {fname} from {mirror}")
                tmp.replace(target)
                break
            except Exception as err:  # noqa: BLE001 - try the next mirror
                last_err = err
        else:
            raise OSError(f"could not download {fname}: {last_err}")


def load_mnist(
    split: str = "train",
    data_home: str | os.PathLike | None = None,
    download: bool = False,
) -> Bunch:
    """MNIST handwritten digits (LeCun, Cortes & Burges), from the IDX ``.gz`` files.

    Parameters
    ----------
    split : {"train", "test"}
        60,000 training or 10,000 test images.
    data_home : path, optional
        Directory holding the four IDX ``.gz`` files (or a ``mnist/`` subdirectory with
        them). Default: search ``$PRIVLEARN_DATA/mnist``, ``$PRIVLEARN_DATA``, then the
        user cache ``~/.cache/privlearn/mnist`` (``$XDG_CACHE_HOME/privlearn/mnist``).
    download : bool
        If the files are not found, download them (checksums verified) into
        ``data_home`` or the cache directory. Off by default: nothing is fetched unless
        asked.

    Returns
    -------
    Bunch
        ``data`` uint8 (n, 28, 28), ``target`` int64 (n,), ``DESCR``.

    Raises
    ------
    DataNotFoundError
        (a :class:`FileNotFoundError`) If the files are not found and ``download`` is
        False.
    """
    if split not in _MNIST_FILES:
        raise ParameterValueError(f"split must be 'train' or 'test', got {split!r}")
    img_name, lbl_name = _MNIST_FILES[split]
    candidates = _mnist_candidate_dirs(data_home)
    found = next(
        (d for d in candidates if (d / img_name).is_file() and (d / lbl_name).is_file()), None
    )
    if found is None:
        if not download:
            raise DataNotFoundError(
                "MNIST files not found in "
                + ", ".join(str(d) for d in candidates)
                + f"; pass data_home=<dir with the four MNIST .gz files>, set {DATA_ENV}, "
                "or download=True", what="MNIST files", searched=candidates)
        found = Path(data_home).expanduser() if data_home is not None else _cache_dir() / "mnist"
        _download_mnist(found)
    images = _parse_idx(_read_gz(found / img_name), 0x00000803)
    labels = _parse_idx(_read_gz(found / lbl_name), 0x00000801).astype(np.int64)
    if images.shape[0] != labels.shape[0]:
        raise DataFormatError("MNIST images and labels have different lengths")
    return Bunch(
        data=images,
        target=labels,
        DESCR=f"MNIST {split} split, read from {found}",
        path=str(found),
    )


# ---------------------------------------------------------------------------------------
# Synthetic logistic-regression data
# ---------------------------------------------------------------------------------------


def make_logistic_data(
    n_train: int = 10000,
    n_test: int = 10000,
    dim: int = 20,
    *,
    random_state: int | np.random.Generator | None = None,
) -> Bunch:
    """Synthetic logistic-regression data of the DP-SGD logistic-regression study.

    ``theta_true ~ N(0, I_d)``; each feature vector is ``z = (1, u)`` with
    ``u ~ Uniform[-1/2, 1/2]^(d-1)`` (so ``|z_j| <= 1``, ``||z||_1 <= d``,
    ``||z||_2 <= sqrt(d)``); ``y ~ Bernoulli(sigmoid(z . theta_true))``. The first
    ``n_train`` rows are the training set, the next ``n_test`` the test set. See
    :doc:`/reference/provenance` for where the design comes from.

    Returns
    -------
    Bunch
        ``X_train``, ``y_train``, ``X_test``, ``y_test`` (labels int64 in {0, 1}),
        ``theta_true``, ``l1_bound`` (= 2d, the study's per-example gradient L1 bound
        ``B1``) and ``l2_bound`` (= 2 sqrt(d), its ``B2``).
    """
    if int(n_train) < 1 or int(n_test) < 0 or int(dim) < 1:
        raise ParameterValueError(
            f"need n_train >= 1, n_test >= 0, dim >= 1; got {n_train}, {n_test}, {dim}"
        )
    rng = np.random.default_rng(random_state)
    n = n_train + n_test
    theta_true = rng.normal(size=dim)
    Z = np.concatenate((np.ones((n, 1)), rng.uniform(size=(n, dim - 1)) - 0.5), axis=1)
    p_true = 1.0 / (1.0 + np.exp(-(Z @ theta_true)))
    y = (rng.uniform(size=n) < p_true).astype(np.int64)
    return Bunch(
        X_train=Z[:n_train],
        y_train=y[:n_train],
        X_test=Z[n_train:],
        y_test=y[n_train:],
        theta_true=theta_true,
        l1_bound=2.0 * dim,
        l2_bound=2.0 * np.sqrt(dim),
        DESCR="Synthetic logistic-regression data (the DP-SGD logistic-regression study)",
    )
