"""The autodp facade refuses bad inputs with privlearn's typed errors (subclasses of
ValueError / TypeError, so autodp-style ``except ValueError`` code keeps working), each
message naming the parameter refused and the value received."""

from __future__ import annotations

import math

import pytest

from privlearn.compat.autodp import (
    calibrator_zoo,
    dp_acct,
    dp_bank,
    fdp_bank,
    mechanism_zoo,
    privacy_calibrator,
    rdp_bank,
    transformer_zoo,
)
from privlearn.compat.autodp.autodp_core import Mechanism
from privlearn.errors import ParameterTypeError, ParameterValueError


def _gauss():
    return mechanism_zoo.GaussianMechanism(sigma=1.0)


CASES = {
    "gaussian-sigma-none": (
        lambda: mechanism_zoo.ExactGaussianMechanism(sigma=None),
        ParameterValueError,
        "sigma",
        "None",
    ),
    "randresp-p-none": (
        lambda: mechanism_zoo.RandresponseMechanism(p=None),
        ParameterValueError,
        "p",
        "None",
    ),
    "laplace-b-none": (
        lambda: mechanism_zoo.LaplaceMechanism(b=None),
        ParameterValueError,
        "b",
        "None",
    ),
    "compose-coeff-length": (
        lambda: transformer_zoo.Composition()([_gauss()], [1, 2]),
        ParameterValueError,
        "coeff_list",
        "got 2",
    ),
    "compose-not-a-mechanism": (
        lambda: transformer_zoo.Composition()(["x"], [1]),
        ParameterTypeError,
        "mechanism_list[0]",
        "str",
    ),
    "rdp-subsampled-prob": (
        lambda: dp_bank.get_eps_rdp_subsampled(lambda a: a, 1e-5, 1.5),
        ParameterValueError,
        "prob",
        "1.5",
    ),
    "randresp-p": (lambda: dp_bank.get_eps_randresp(1.5, 1e-5), ParameterValueError, "p", "1.5"),
    "fdp-sigma": (
        lambda: fdp_bank.fDP_gaussian({"sigma": -1.0}, 0.5),
        ParameterValueError,
        "sigma",
        "-1.0",
    ),
    "fdp-fpr": (
        lambda: fdp_bank.fDP_gaussian({"sigma": 1.0}, 1.5),
        ParameterValueError,
        "fpr",
        "1.5",
    ),
    "rdp-alpha": (
        lambda: rdp_bank.RDP_gaussian({"sigma": 1.0}, 0.5),
        ParameterValueError,
        "alpha",
        "0.5",
    ),
    "svt-b": (
        lambda: rdp_bank.RDP_svt_laplace({"b": -1.0, "k": 2, "c": 1}, 2.0),
        ParameterValueError,
        "b",
        "-1.0",
    ),
    "noisy-screen-logp": (
        lambda: rdp_bank.RDP_noisy_screen({"logp": 0.5, "logq": -1.0}, 2.0),
        ParameterValueError,
        "logp",
        "0.5",
    ),
    "calibrate-eps": (
        lambda: privacy_calibrator.gaussian_mech(-1.0, 1e-5),
        ParameterValueError,
        "eps",
        "-1.0",
    ),
    "classical-eps": (
        lambda: privacy_calibrator.classical_gaussian_mech(2.0, 1e-5),
        ParameterValueError,
        "eps",
        "2.0",
    ),
    "calibrator-bounds": (
        lambda: calibrator_zoo.eps_delta_calibrator()(
            mechanism_zoo.GaussianMechanism, 1.0, 1e-5, [5.0, 1.0]
        ),
        ParameterValueError,
        "bounds",
        "[5.0, 1.0]",
    ),
    "dp-acct-eps": (
        lambda: dp_acct.DP_acct().update_DPlosses(-1.0, 0.1),
        ParameterValueError,
        "eps",
        "-1.0",
    ),
    "rdp-update-func": (
        lambda: Mechanism().propagate_updates(5, type_of_update="RDP"),
        ParameterTypeError,
        "func",
        "5",
    ),
    "approxdp-pair": (
        lambda: Mechanism().propagate_updates(5, type_of_update="approxDP"),
        ParameterValueError,
        "func",
        "5",
    ),
    "set-all-representation": (
        lambda: Mechanism().set_all_representation(3),
        ParameterTypeError,
        "mech",
        "int",
    ),
    "eps-pure-dp": (
        lambda: setattr(Mechanism(), "eps_pureDP", -1.0),
        ParameterValueError,
        "eps_pureDP",
        "-1.0",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_refused_input_raises_a_typed_error_naming_the_parameter(case):
    call, kind, name, value = CASES[case]
    with pytest.raises(kind) as err:
        call()
    assert isinstance(err.value, ValueError if kind is ParameterValueError else TypeError)
    msg = str(err.value)
    assert name in msg and value in msg, msg


def test_nan_parameter_names_it():
    with pytest.raises(ParameterValueError, match="sigma"):
        fdp_bank.fDP_gaussian({"sigma": math.nan}, 0.5)
