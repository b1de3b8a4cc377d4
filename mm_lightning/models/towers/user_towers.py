"""A tower of your own, checked once when the model is built: one dry forward checks what it returns against the
contract and gives its widths (declared ones must agree), and its data config is completed, so the network treats
it as a built-in tower (loaded only for such a tower)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mm_lightning.models.towers.contract import (
    EncoderOutput,
    Kind,
    TowerContractError,
    call_text_tower,
    checked_encoder_output,
    class_path_of,
    contract_problem,
    image_data_config,
)

DRY_BATCH = 2  # BatchNorm in a tower's forward needs more than one sample
DRY_CAPTION_LENGTH = 8


def _dry_forward(kind: Kind, tower: nn.Module, image_size: int) -> EncoderOutput:
    """One forward of a dry batch, without gradient and in eval mode (running statistics untouched)."""
    device = next((p.device for p in tower.parameters()), torch.device("cpu"))
    was_training = tower.training
    tower.eval()
    try:
        with torch.no_grad():
            if kind == "image":
                side = int(_declared_data_config(tower).get("input_size", (3, image_size, image_size))[-1])
                described = f"a dry batch of {DRY_BATCH} images of 3x{side}x{side}"
                out = tower(torch.zeros(DRY_BATCH, 3, side, side, device=device))
            else:
                ids = torch.ones(DRY_BATCH, DRY_CAPTION_LENGTH, dtype=torch.long, device=device)
                described = f"a dry batch of {DRY_BATCH} captions of {DRY_CAPTION_LENGTH} tokens"
                out = call_text_tower(tower, ids, torch.ones_like(ids), torch.zeros_like(ids), False)
    except TowerContractError:
        raise
    except Exception as error:  # noqa: BLE001  (any failure of the user's forward is reported with its class)
        raise contract_problem(
            kind, tower, f"its forward failed on {described}: {type(error).__name__}: {error}"
        ) from error
    finally:
        tower.train(was_training)
    return checked_encoder_output(kind, tower, out, DRY_BATCH)


def _declared_data_config(tower: nn.Module) -> dict[str, Any]:
    try:
        config = getattr(tower, "data_config", None)
    except NotImplementedError:
        return {}
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise TowerContractError(
            f"tower {class_path_of(tower)}: data_config is a {type(config).__name__}, expected a dict"
        )
    return config


def adopt_tower(kind: Kind, tower: Any) -> nn.Module:
    """Checks a tower of your own against the contract; records its widths and data config on it."""
    if not isinstance(tower, nn.Module):
        raise TowerContractError(
            f"{kind} tower {class_path_of(tower)} is not a torch.nn.Module (the tower contract: "
            "mm_lightning/models/towers/contract.py)"
        )
    declared = _declared_data_config(tower)
    size = declared.get("input_size", (3, getattr(tower, "image_size", 224)))[-1]
    image_size = int(size) if isinstance(size, int) else 224
    out = _dry_forward(kind, tower, image_size)
    pooled_dim, token_dim = out.pooled.shape[1], out.tokens.shape[2]
    for name, found in (("pooled_dim", pooled_dim), ("token_dim", token_dim)):
        declared_width = getattr(tower, name, None)
        if declared_width is None:
            continue
        if not isinstance(declared_width, int) or isinstance(declared_width, bool) or declared_width != found:
            raise TowerContractError(
                f"{kind} tower {class_path_of(tower)}: {name} is {declared_width!r}, but its forward returns"
                f" {found} (on a dry batch of {DRY_BATCH})"
            )
    if kind == "image":
        defaults = {**image_data_config(image_size), "pretrained": False}
        unknown = sorted(set(declared) - set(defaults))
        if unknown:
            raise TowerContractError(
                f"image tower {class_path_of(tower)}: data_config has unknown key(s) {unknown}; "
                f"known: {sorted(defaults)}"
            )
        data_config = {**defaults, **declared}
    else:
        data_config = {"tokenizer": getattr(tower, "tokenizer", None), **declared}
    # plain attributes, not parameters or buffers: checkpoints are unchanged
    if getattr(tower, "pooled_dim", None) is None:
        tower.pooled_dim = int(pooled_dim)
    if getattr(tower, "token_dim", None) is None:
        tower.token_dim = int(token_dim)
    tower.mm_lightning_data_config = data_config
    return tower
