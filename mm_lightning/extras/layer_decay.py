"""Layer-wise learning-rate decay (BEiT's and open_clip's ``layer_decay``): the tower's layer groups, input to
output, train at ``lr * decay ** (depth - i)``: the last group at the tower's rate, each earlier one ``decay``
times slower, so fine-tuning moves the pretrained lower layers least."""

from __future__ import annotations

from torch import nn

from mm_lightning.models.towers.contract import Kind, checked_layer_groups


def decayed_layer_rates(
    kind: Kind, tower: nn.Module, lr: float, decay: float
) -> dict[str, tuple[list[tuple[str, nn.Parameter]], float]]:
    """``{"<kind>_encoder_layer<i>": (named parameters, lr * decay ** (depth - i))}`` over the tower's layer groups
    (``depth`` = the number of groups - 1); parameters in no group keep the tower's rate."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"model.{kind}.layer_decay must be in (0, 1], got {decay}")
    groups = checked_layer_groups(kind, tower, "layer_decay")
    if len(groups) < 2:
        raise ValueError(
            f"model.{kind}.layer_decay: {type(tower).__name__}'s layer_groups() gives a single group, nothing to decay"
        )
    parameters = dict(tower.named_parameters())
    depth = len(groups) - 1
    return {
        f"{kind}_encoder_layer{i}": ([(name, parameters[name]) for name in group], lr * decay ** (depth - i))
        for i, group in enumerate(groups)
    }
