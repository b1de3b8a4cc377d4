"""Layer-wise learning-rate decay (BEiT's and open_clip's ``layer_decay``): the tower's layer groups, input to
output, train at ``lr * decay ** (depth - i)``: the last group at the tower's rate, each earlier one ``decay``
times slower, so fine-tuning moves the pretrained lower layers least.

    model:
      param_groups:
        class_path: mm_lightning.extras.LayerDecay
        init_args: {image: 0.75, text: 0.8}
"""

from __future__ import annotations

from torch import nn

from mm_lightning.models.rules import NamedParameters, ParamGroupRule
from mm_lightning.models.towers.contract import Kind, checked_layer_groups


class LayerDecay(ParamGroupRule):
    """One learning-rate group per layer group of each tower given a decay (``layer_groups()``, input to output).

    Args:
        image: the image tower's decay in (0, 1] (null: the tower is one group).
        text: the text tower's decay (the same)."""

    def __init__(self, image: float | None = None, text: float | None = None) -> None:
        self.decay: dict[Kind, float | None] = {"image": image, "text": text}
        for kind, decay in self.decay.items():
            if decay is not None and not 0.0 < decay <= 1.0:
                raise ValueError(f"model.param_groups: LayerDecay's {kind} must be in (0, 1], got {decay}")

    def groups(self, towers: dict[str, tuple[nn.Module, float]]) -> dict[str, tuple[NamedParameters, float]]:
        groups: dict[str, tuple[NamedParameters, float]] = {}
        for kind, decay in self.decay.items():
            if decay is not None:
                tower, lr = towers[kind]
                groups |= decayed_layer_rates(kind, tower, lr, decay)
        return groups


def decayed_layer_rates(
    kind: Kind, tower: nn.Module, lr: float, decay: float
) -> dict[str, tuple[NamedParameters, float]]:
    """``{"<kind>_encoder_layer<i>": (named parameters, lr * decay ** (depth - i))}`` over the tower's layer groups
    (``depth`` = the number of groups - 1); parameters in no group keep the tower's rate."""
    groups = checked_layer_groups(kind, tower, f"model.param_groups (LayerDecay's {kind})")
    if len(groups) < 2:
        raise ValueError(
            f"model.param_groups: LayerDecay's {kind}: {type(tower).__name__}'s layer_groups() gives a single group,"
            " nothing to decay"
        )
    parameters = dict(tower.named_parameters())
    depth = len(groups) - 1
    return {
        f"{kind}_encoder_layer{i}": ([(name, parameters[name]) for name in group], lr * decay ** (depth - i))
        for i, group in enumerate(groups)
    }
