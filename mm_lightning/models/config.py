"""The model's option groups (tower training, fusion, loss weighting, optimization): ``MultimodalModule``
takes them as nested CLI/YAML groups (``--model.optim.lr 3e-3``), dataclasses or dicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class TowerTraining:
    """How a tower trains: the same options for any tower, built in or your own.

    Args:
        freeze: fixed weights, the tower in eval mode (LiT-style).
        train_last: train the last N ``layer_groups()`` only, the rest locked in eval mode (null: all).
        freeze_batchnorm: BatchNorm in eval mode (statistics fixed): exact gradient caching.
        project: learn a projection (false: the pooled output, of ``embed_dim`` width).
        lr: the tower's learning rate (null: ``optim.lr``; 0 is valid).
        clip_norm: max gradient norm of the tower (null: none)."""

    freeze: bool = False
    train_last: int | None = None
    freeze_batchnorm: bool = False
    project: bool = True
    lr: float | None = None
    clip_norm: float | None = None


@dataclass(frozen=True)
class FusionConfig:
    """The cross-attention fusion feeding the image-text matching (ITM) head.

    Args:
        layers: fusion layers.
        heads: attention heads (must divide ``embed_dim``).
        bidirectional: also let the text tokens attend to the image tokens."""

    layers: int = 1
    heads: int = 8
    bidirectional: bool = False


@dataclass(frozen=True)
class ObjectiveConfig:
    """How the loss terms are weighted: the pair loss's (``itc`` and its own named terms) and ITM's.

    Args:
        itc_weight: weight of the pair loss's ``itc`` term.
        itm_weight: weight of the ITM loss; 0 switches ITM (and the fusion module) off.
        term_weights: weights of a loss's other named terms (default 1 each), e.g. ``{uniformity: 0.1}``."""

    itc_weight: float = 1.0
    itm_weight: float = 1.0
    term_weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        taken = sorted({"itc", "itm"} & set(self.term_weights))
        if taken:
            raise ValueError(f"objective.term_weights {taken}: set objective.itc_weight / itm_weight instead")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay per step (tower learning rates live in the tower groups).

    Args:
        lr: learning rate of new heads (projections, fusion, ITM head, temperature) and towers' default.
        weight_decay: AdamW weight decay (biases, norms and the temperature are excluded).
        warmup_steps: linear warmup steps.
        min_lr_ratio: final LR / peak LR of the cosine decay.
        clip_heads: max gradient norm of the parameters outside the towers (null: none).
        fused: AdamW's fused kernel (null: fused when every parameter is on a CUDA device).
        lr_scaling: LR rule when a resume changes the global batch."""

    lr: float = 1e-4
    weight_decay: float = 0.05
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_heads: float | None = None
    fused: bool | None = None
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"


# shared defaults of MultimodalModule's arguments (frozen, so sharing them is safe)
# the LightningModule keeps the network under this attribute (checkpoint keys start with "model.")
CHECKPOINT_PREFIX = "model."
# the network's parts a config names by class_path, recorded so in checkpoints
PARTS = ("image_tower", "text_tower", "loss")

DEFAULT_TRAINING = TowerTraining()
DEFAULT_FUSION = FusionConfig()
DEFAULT_OBJECTIVE = ObjectiveConfig()
DEFAULT_OPTIM = OptimConfig()
