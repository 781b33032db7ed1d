"""One name for each privacy parameter across the public API: ``epsilon``, ``delta``,
``noise_multiplier``, ``sampling_rate``, ``max_grad_norm``, ``steps`` (the names of the
field). The former names of public keywords (``eps``, ``sigma``, ``q``, ``alphas``)
still work, with a DeprecationWarning; both spellings at once are refused. (The torch
samplers' ``sample_rate``: tests/torch/test_sampling_rate_name.py.)"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import pkgutil
import warnings

import numpy as np
import pytest

import privlearn
from privlearn.accounting import closed_form as cf
from privlearn.accounting import pairs, rdp
from privlearn.errors import ParameterTypeError
from privlearn.experiments import linear_regression as lr_study
from privlearn.models.linear import noisy_gd_paths

#: names of the field's parameters that privlearn spells otherwise nowhere in public
FORMER = {
    "sample_rate",
    "eps",
    "sigma",
    "noise_scale",
    "num_steps",
    "n_steps",
    "clip_norm",
    "l2_norm_clip",
    "sampling_probability",
}
#: packages whose names are another library's on purpose (autodp's facade)
_COMPAT = ("privlearn.compat",)
_TORCH = importlib.util.find_spec("torch") is not None


def _public_modules():
    for info in pkgutil.walk_packages(privlearn.__path__, "privlearn."):
        parts = info.name.split(".")
        if info.name.startswith(_COMPAT) or any(p.startswith("_") for p in parts[1:]):
            continue
        if not _TORCH and ("torch" in parts or info.name == "privlearn.auditing.torch"):
            continue
        if info.name == "privlearn.torch.hf":  # transformers' names; slow to import
            continue
        yield importlib.import_module(info.name)


def _signatures(mod):
    for name in getattr(mod, "__all__", ()):
        obj = getattr(mod, name)
        found = [(name, obj)]
        if inspect.isclass(obj):
            found += [
                (f"{name}.{k}", v)
                for k, v in vars(obj).items()
                if callable(v) and (not k.startswith("_") or k == "__init__")
            ]
        for qual, fn in found:
            try:
                yield f"{mod.__name__}.{qual}", inspect.signature(fn).parameters
            except (TypeError, ValueError):  # a builtin without a signature
                continue


def test_no_public_signature_uses_a_former_name():
    hits = sorted(
        {
            f"{where}({p})"
            for mod in _public_modules()
            for where, params in _signatures(mod)
            for p in FORMER & set(params)
        }
    )
    assert hits == []


def _same_with_both_names(call, new: str, old: str, value):
    """``call(**{new: value})`` warns nothing; ``call(**{old: value})`` warns and gives the
    same; both at once are refused. Returns the result."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        want = call(**{new: value})
    with pytest.warns(DeprecationWarning, match=f"keyword {old} is deprecated; pass {new}"):
        got = call(**{old: value})
    with pytest.raises(ParameterTypeError, match=f"both {new} and {old}"):
        call(**{new: value, old: value})
    return want, got


def test_laplace_delta_takes_epsilon():
    b, e = 2.0, 0.1
    want, got = _same_with_both_names(lambda **k: cf.laplace_delta(b, **k), "epsilon", "eps", e)
    exact = -math.expm1((e - 1.0 / b) / 2.0)  # 1 - exp((eps - 1/b) / 2)
    assert want == got and want[0] <= exact <= want[1]
    with pytest.raises(ParameterTypeError, match="both epsilon and eps"):
        cf.laplace_delta(b, e, eps=e)  # the new one by position


def test_pure_and_approx_dp_atoms_take_epsilon():
    want, got = _same_with_both_names(cf.pure_dp_atoms, "epsilon", "eps", 1.0)
    assert want == got and want.loss == (1.0, -1.0)
    want, got = _same_with_both_names(
        lambda **k: cf.approx_dp_atoms(delta=1e-3, **k), "epsilon", "eps", 1.0
    )
    assert want == got and want.inf_mass == 1e-3


def test_discrete_pld_and_pair_delta_take_epsilon():
    # randomized response at eps0 = 1: delta(e) = p - e^e (1 - p), p = e^1 / (1 + e^1)
    p = math.e / (1.0 + math.e)
    exact = p - math.exp(0.5) * (1.0 - p)
    pld = cf.discrete_pld(privlearn.accounting.PureDP(1.0))[0]
    want, got = _same_with_both_names(pld.delta, "epsilon", "eps", 0.5)
    assert want == got == pytest.approx(exact, rel=1e-12)
    want, got = _same_with_both_names(pairs.pure_dp_pair, "epsilon", "eps", 1.0)
    d_new, d_old = _same_with_both_names(want.delta, "epsilon", "eps", np.array([0.5]))
    assert np.array_equal(d_new, d_old) and d_new[0] == pytest.approx(exact, rel=1e-12)


def test_subsampled_gaussian_rdp_takes_the_field_names():
    orders = np.array([2.0, 3.0, 8.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = rdp.subsampled_gaussian_rdp(sampling_rate=0.5, noise_multiplier=2.0, orders=orders)
    with pytest.warns(
        DeprecationWarning,
        match="keywords q, sigma, alphas are deprecated; "
        "pass sampling_rate, noise_multiplier, orders",
    ):
        old = rdp.subsampled_gaussian_rdp(q=0.5, sigma=2.0, alphas=orders)
    assert np.array_equal(new, old)
    peer = pytest.importorskip("opacus.accountants.analysis.rdp")  # Mironov et al. 2019
    theirs = [peer._compute_rdp(0.5, 2.0, float(a)) for a in orders]
    assert new == pytest.approx(theirs, rel=1e-9)
    with pytest.raises(ParameterTypeError, match="both noise_multiplier and sigma"):
        rdp.subsampled_gaussian_rdp(0.5, 2.0, orders, sigma=2.0)


def test_noisy_gd_paths_takes_noise_multiplier():
    xtx, xty = np.eye(2), np.ones(2)

    def run(**k):
        return noisy_gd_paths(
            xtx, xty, lr=0.1, n_iter=5, x_bound=1.0, y_bound=1.0, rng=np.random.default_rng(0), **k
        )[0]

    want, got = _same_with_both_names(run, "noise_multiplier", "sigma", 3.0)
    assert np.array_equal(want, got) and not np.array_equal(want, run(noise_multiplier=0.0))


def test_the_linear_regression_study_takes_noise_multiplier():
    for fn in (lr_study.run_noisygd_learning_rate, lr_study.SeedProblem.noisy_gd):
        assert "noise_multiplier" in inspect.signature(fn).parameters
    with pytest.raises(ParameterTypeError, match="both noise_multiplier and sigma"):
        lr_study.run_noisygd_learning_rate(noise_multiplier=5.0, sigma=5.0)
    with pytest.raises(ParameterTypeError, match="both noise_multiplier and sigma"):
        lr_study.SeedProblem.noisy_gd(None, 5.0, sigma=5.0)


@pytest.mark.skipif(not _TORCH, reason="torch is not installed")
def test_the_ledger_link_takes_the_field_names():
    from privlearn.torch.accountant import LedgerLink

    for name in ("reserve", "covered", "ensure", "used"):
        params = inspect.signature(getattr(LedgerLink, name)).parameters
        assert list(params)[1:3] == ["noise_multiplier", "sampling_rate"], name
    with pytest.raises(ParameterTypeError, match="both noise_multiplier and sigma"):
        LedgerLink.covered(None, 1.0, 0.1, sigma=1.0)
