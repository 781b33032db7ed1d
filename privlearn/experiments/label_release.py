"""PATE and Private kNN label release on MNIST: label accuracy vs epsilon.

Setting (fast on a CPU): pixels scaled to [0, 1] and projected on 50 principal
components fitted on the *public* part of the data (test images not used as queries),
so the feature map costs no privacy. Private data: the 60,000 training images.

* PATE: ``n_teachers`` nearest-centroid teachers on disjoint partitions of the private
  set; hard votes on each query, noisy argmax.
* Private kNN: for each query a Poisson subsample (rate ``q``) of the private set, the
  ``k`` nearest sampled neighbours vote, noisy argmax.

Queries: the first ``n_queries`` test images; the label accuracy is measured against
their true labels. Both are (epsilon, delta)-DP for the whole batch of queries.
"""

from __future__ import annotations

import numpy as np

from privlearn.datasets import load_mnist
from privlearn.experiments._common import (
    ExperimentResult,
    accuracy_spread,
    epsilon_log_axis,
    format_table,
    median_errorbar,
    prepare_out_dir,
    progress,
    pyplot,
    save_figure,
    write_csv,
)
from privlearn.models.label_release import PATE, PrivateKNN

__all__ = ["run_label_release", "mnist_features", "nearest_centroid_teachers"]


def mnist_features(n_components: int = 50, n_private: int | None = None,
                   n_public_fit: int = 5000, data_home=None, download: bool = False):
    """PCA features; the PCA basis is fitted on the last ``n_public_fit`` test images.

    ``data_home`` and ``download`` are passed to :func:`privlearn.datasets.load_mnist`.
    """
    tr = load_mnist("train", data_home, download=download)
    te = load_mnist("test", data_home, download=download)
    Xtr = tr.data.reshape(len(tr.data), -1).astype(np.float64) / 255.0
    Xte = te.data.reshape(len(te.data), -1).astype(np.float64) / 255.0
    ytr, yte = tr.target, te.target
    if n_private is not None:
        Xtr, ytr = Xtr[:n_private], ytr[:n_private]
    pub = Xte[-n_public_fit:]
    mean = pub.mean(axis=0)
    # Principal axes from the 784 x 784 scatter matrix (eigh) rather than an SVD of the
    # 5000 x 784 block: the same subspace (axes equal up to sign, which nearest-centroid
    # and kNN distances ignore), about 10x faster.
    C = (pub - mean).T @ (pub - mean)
    _, vecs = np.linalg.eigh(C)
    W = vecs[:, ::-1][:, :n_components]
    return (Xtr - mean) @ W, ytr, (Xte - mean) @ W, yte


def nearest_centroid_teachers(X, y, n_teachers: int, queries, rng, n_classes: int = 10):
    """Hard votes (n_teachers, n_queries) of nearest-centroid teachers trained on a random
    disjoint partition of (X, y).

    Each record joins a teacher drawn for it alone (independent uniform draws), so adding
    or removing one record changes one teacher's data and nothing else: the premise of
    PATE's sensitivity (``sqrt(2)`` in L2, ``2`` in L1) under add/remove neighbouring.
    Cutting one shuffled list into near-equal parts would not do: a record added moves
    the cut points, and other records change teachers.
    """
    owner = rng.integers(n_teachers, size=len(X))
    parts = [np.flatnonzero(owner == t) for t in range(n_teachers)]
    votes = np.zeros((n_teachers, len(queries)), dtype=np.int64)
    qsq = np.einsum("ij,ij->i", queries, queries)
    for t, idx in enumerate(parts):
        Xi, yi = X[idx], y[idx]
        cent = np.zeros((n_classes, X.shape[1]))
        for c in range(n_classes):
            sel = yi == c
            cent[c] = Xi[sel].mean(axis=0) if np.any(sel) else np.inf
        with np.errstate(invalid="ignore"):  # a class the part lacks: inf - inf, never chosen
            d2 = qsq[:, None] - 2 * queries @ cent.T + np.einsum("ij,ij->i", cent, cent)[None]
        votes[t] = np.argmin(np.nan_to_num(d2, nan=np.inf), axis=1)
    return votes


def run_label_release(out_dir=None, reps: int | None = None, seed: int = 0, *,
                      epsilons=(0.5, 1.0, 2.0, 4.0, 8.0), delta: float = 1e-6,
                      n_queries: int = 1000, n_teachers: int = 100, n_neighbors: int = 100,
                      sampling_rate: float = 0.1, n_private: int | None = None,
                      noise: str = "gaussian", data_home=None, download: bool = False,
                      plot: bool = True,
                      show_progress: bool | None = None,
                      verbose: bool = False) -> ExperimentResult:
    """Label accuracy of PATE and Private kNN vs epsilon (median over ``reps``, default 3)."""
    out = prepare_out_dir(out_dir)
    reps = reps or 3
    Xtr, ytr, Xte, yte = mnist_features(n_private=n_private, data_home=data_home,
                                        download=download)
    Q, yq = Xte[:n_queries], yte[:n_queries]
    rng = np.random.default_rng(seed)
    teacher_votes = nearest_centroid_teachers(Xtr, ytr, n_teachers, Q, rng)
    hist = PATE.vote_histogram(teacher_votes, 10)
    acc_pate_clean = float(np.mean(np.argmax(hist, 1) == yq))
    acc = np.zeros((2, len(epsilons), reps))
    spent = np.zeros((2, len(epsilons)))
    jobs = [(i, r) for i in range(len(epsilons)) for r in range(reps)]
    for i, r in progress(jobs, desc="label release", enabled=show_progress):
        eps = float(epsilons[i])
        pate = PATE(epsilon=eps, delta=delta, noise=noise, random_state=seed * 1000 + r)
        acc[0, i, r] = np.mean(pate.release(teacher_votes, 10, n_teachers=n_teachers) == yq)
        spent[0, i] = pate.epsilon_
        # one account per (epsilon, repetition): fit is cheap (it stores the arrays), and
        # releases from one fitted object would compose into one account
        knn = PrivateKNN(n_neighbors=n_neighbors, sampling_rate=sampling_rate, epsilon=eps,
                         delta=delta, noise=noise, random_state=seed * 1000 + r,
                         classes=np.arange(10)).fit(Xtr, ytr)
        acc[1, i, r] = np.mean(knn.release(Q) == yq)
        spent[1, i] = knn.epsilon_
    rows = []
    for m, name in enumerate(("PATE", "PrivateKNN")):
        for i, e in enumerate(epsilons):
            rows.append(dict(method=name, epsilon=float(e), delta=delta, noise=noise,
                             epsilon_spent=float(spent[m, i]),
                             **accuracy_spread(acc[m, i]), n_queries=n_queries,
                             reps=reps))
    rows.append(dict(method="PATE (no noise)", epsilon=float("inf"),
                     median_accuracy=acc_pate_clean, n_queries=n_queries))
    csv_path = write_csv(out / "label_release.csv", rows)
    png = None
    if plot:
        plt = pyplot()

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, name in enumerate(("PATE", "Private kNN")):
            median_errorbar(ax, epsilons, acc[m], fmt="o-", capsize=3,
                            label=f"{name} (median of {reps})")
        ax.axhline(acc_pate_clean, color="k", ls="--", label="teacher ensemble, no noise")
        epsilon_log_axis(ax, epsilons)
        ax.set_xlabel(f"epsilon ({n_queries} queries, delta={delta:g})")
        ax.set_ylabel("label accuracy")
        ax.grid(alpha=0.3)
        ax.set_title("MNIST label release")
        ax.legend()
        png = save_figure(fig, out / "label_release.png")
    if verbose:
        print(format_table(rows, ["method", "epsilon", "median_accuracy", "epsilon_spent"]))
    return ExperimentResult("label-release", csv_path, png, rows=rows)
