"""The files under ``private_state_dir`` that hold the secret part of a DPTrainer
checkpoint's privacy state.

The checkpoint folder is a release; what continues the run's randomness (the keys of the
sampler and of the noise, correlated noise's last noises, the global generators' states)
is written to a file of its own, readable by its owner only, outside it. The two are bound
by a random token, saved in the checkpoint's public state and in the private file: it
reveals nothing, and it is what a resume looks the private file up by, so a checkpoint
folder copied or renamed (``last-checkpoint`` as ``push_to_hub(hub_strategy=
"checkpoint")`` uploads it, ``checkpoint-500`` copied to ``best/``) still resumes, while a
private file of another checkpoint never matches."""

from __future__ import annotations

import os
import re
import secrets
from typing import TYPE_CHECKING

import torch

from privlearn.errors import ConfigurationError, ParameterValueError
from privlearn.torch.schedule import independent

if TYPE_CHECKING:
    from privlearn.torch._hf_args import PrivacyArguments

__all__ = ["PRIVATE_FORMAT", "check_private_state_dir", "find_private_state", "new_token",
           "join_users", "private_state_path", "remove", "save_private", "saves_checkpoints",
           "secret_parts", "split_users"]

PRIVATE_FORMAT = "privlearn.torch.hf.private_state/1"
_TOKEN = re.compile(r"[0-9a-f]{16}")


def new_token() -> str:
    """A fresh random token binding a checkpoint's public and private parts."""
    return secrets.token_hex(8)


def private_state_path(private_dir: str, checkpoint: str, token: str) -> str:
    """Where the private file of ``checkpoint`` (saved with ``token``) is written: the
    folder's name is there for people; the token is what a resume matches."""
    name = os.path.basename(os.path.normpath(checkpoint))
    return os.path.join(private_dir, f"{name}.{token}.pt")


def find_private_state(private_dir: str, checkpoint: str, token) -> str | None:
    """The private file in ``private_dir`` saved with ``token`` (the one written for
    ``checkpoint`` under its own name first, else one written for the same checkpoint
    under another folder name); ``None`` when there is none."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ParameterValueError(
            f"checkpoint {checkpoint!r}: its privacy state's token {token!r} is not one "
            "DPTrainer writes (16 hex digits); the file was altered or not written by "
            "DPTrainer. Resume from a DPTrainer checkpoint, or start a new run")
    path = private_state_path(private_dir, checkpoint, token)
    if os.path.isfile(path):
        return path
    suffix = f".{token}.pt"
    try:
        names = sorted(os.listdir(private_dir))
    except (FileNotFoundError, NotADirectoryError):
        return None
    for name in names:
        candidate = os.path.join(private_dir, name)
        if name.endswith(suffix) and os.path.isfile(candidate):
            return candidate
    return None


def save_private(obj: dict, path: str) -> None:
    """``torch.save`` into a file only its owner can read (written whole, then renamed)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
    os.replace(tmp, path)


def remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def secret_parts(privacy: PrivacyArguments) -> tuple[str, ...]:
    """The parts of :meth:`PrivateTraining.state_dict` that must not be released: the
    keys of the sampler and of the noise (they replay the next steps' batches and noise;
    a ``secure_mode`` run has none) and the correlated noise's state (past noises)."""
    parts = () if privacy.secure_mode else ("sampler", "noise")
    parts += () if independent(privacy.noise) else ("correlated",)
    return parts + (() if privacy.user_column is None else ("users",))


def split_users(state: dict) -> dict:
    """``state`` with the grouping of the examples into users (the mechanism's
    ``users``: a digest of which examples each user holds, an un-noised function of the
    training set) moved out of the mechanism into a ``users`` part of its own, kept with
    the secret part; the mechanism keeps the number of users."""
    mechanism = dict(state["mechanism"])
    grouping = mechanism["users"]
    mechanism["users"] = grouping.split(",")[0]  # "N users"
    return {**state, "mechanism": mechanism, "users": grouping}


def join_users(state: dict) -> dict:
    """The inverse of :func:`split_users` (a state without a ``users`` part unchanged)."""
    if "users" not in state:
        return state
    state = dict(state)
    grouping = state.pop("users")
    return {**state, "mechanism": {**state["mechanism"], "users": grouping}}


def saves_checkpoints(args) -> bool:
    return str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"


def check_private_state_dir(path, args, privacy: PrivacyArguments) -> str | None:
    """Validate ``private_state_dir``: required with checkpoints and a secret state,
    outside ``output_dir``."""
    parts = secret_parts(privacy)
    if path is None:
        if parts and saves_checkpoints(args):
            what = []
            if "correlated" in parts:
                what.append(f"noise={privacy.noise!r} continues from its last noises")
            if "sampler" in parts:
                what.append("the sampler's and the noise's keys replay the next steps' "
                            "batches and noise")
            secret = [f"({'; '.join(what)}: with a later model they reveal an un-noised "
                      "clipped gradient)"] if what else []
            if "users" in parts:
                secret.append("(the grouping of the examples into users, checked on resume: "
                              "a digest of which examples each user holds, un-noised)")
            raise ConfigurationError(
                "private_state_dir is required with checkpoints (save_strategy="
                f"{str(getattr(args.save_strategy, 'value', args.save_strategy))!r}): a "
                "checkpoint folder is a release (push_to_hub uploads it), and continuing this "
                f"run needs secret state {' and '.join(secret)}. Pass "
                "DPTrainer(private_state_dir=...) a folder outside output_dir, as private as "
                "the training data, or set save_strategy='no'"
                + ("" if {"correlated", "users"} & set(parts)
                   else ", or use secure_mode=True (no keys)"))
        return None
    path = os.path.abspath(os.fspath(path))
    out = os.path.realpath(args.output_dir)
    if os.path.commonpath([out, os.path.realpath(path)]) == out:
        raise ConfigurationError(
            f"private_state_dir={path!r} is inside output_dir={args.output_dir!r}: "
            "output_dir holds releases (the checkpoints, what push_to_hub uploads and "
            "save_model writes). Name a folder outside it, kept as private as the data")
    return path
