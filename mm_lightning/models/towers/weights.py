"""A tower's weights from a local file (``.safetensors`` or a torch state dict), checked key by key and shape by
shape."""

from __future__ import annotations

import os
import warnings

import torch
from safetensors.torch import load_file
from torch import Tensor, nn


def read_state_dict(path: str) -> dict[str, Tensor]:
    """Reads a ``.safetensors`` or torch (weights_only) state dict, unwrapping ``state_dict``/``model``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file {path!r} does not exist")
    try:
        if path.lower().endswith(".safetensors"):
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (any reader failure is reported with the file name)
        raise ValueError(f"weights file {path!r} could not be read: {error}") from error
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"weights file {path!r} holds no state dict of tensors")
    return state


def load_weights_file(
    module: nn.Module, path: str, strict: bool = True, ignored: set[str] | frozenset[str] = frozenset()
) -> None:
    """Loads a local state dict into ``module``; missing or unexpected keys fail (or warn, not ``strict``).

    ``ignored``: keys the file may hold that ``module`` lacks (a dropped classifier head).
    """
    load_checked_state_dict(module, read_state_dict(path), f"weights file {path!r}", strict, ignored)


def load_checked_state_dict(
    module: nn.Module,
    state: dict[str, Tensor],
    source: str,
    strict: bool = True,
    ignored: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Loads ``state`` into ``module`` after checking keys and shapes (see :func:`load_weights_file`)."""
    prefix = "backbone."  # a state dict saved from the tower itself
    if state and all(k.startswith(prefix) for k in state):
        state = {k[len(prefix) :]: v for k, v in state.items()}
    state = {k: v for k, v in state.items() if k not in ignored}
    own = module.state_dict()
    mismatched = [
        f"{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and own[k].shape != v.shape
    ]
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    problems = [
        f"{label} ({len(keys)}): {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
        for label, keys in (("shape mismatch", mismatched), ("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    if mismatched or (strict and problems):
        hint = "" if mismatched else " (strict=false loads the matching keys only)"
        raise ValueError(f"{source} does not fit {type(module).__name__}: {'; '.join(problems)}{hint}")
    if problems:
        warnings.warn(f"{source} loaded partially: " + "; ".join(problems), stacklevel=2)
    module.load_state_dict(state, strict=False)
