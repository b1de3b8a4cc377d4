"""The network of a training checkpoint, rebuilt for inference, export or zero-shot classification
(``DualEncoder.from_checkpoint``; loaded only then)."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.cli import instantiate_class
from torch import nn

from mm_lightning.models.config import CHECKPOINT_PREFIX, DEFAULT_FUSION, DEFAULT_TRAINING, PARTS


def network_from_checkpoint(
    cls: type, path: str | os.PathLike, map_location: Any, parts: dict[str, nn.Module]
) -> Any:
    """``cls`` (a ``DualEncoder``) built from the checkpoint's recorded parts and options, with its weights."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise TypeError(f"DualEncoder.from_checkpoint: unknown part(s) {unknown}; the parts: {list(PARTS)}")
    checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    hparams = checkpoint.get("hyper_parameters") or {}
    built = {}
    for name in PARTS:
        spec = hparams.get(name)
        if name in parts:
            built[name] = parts[name]
        elif isinstance(spec, dict) and "class_path" in spec:
            built[name] = instantiate_class((), spec)
        elif name != "loss":
            raise ValueError(
                f"{path}: the checkpoint records no {name} (its module was built in Python); pass it: "
                f"DualEncoder.from_checkpoint(path, {name}=...)"
            )
    objective = hparams.get("objective") or {}
    model = cls(
        **built,
        image=hparams.get("image") or DEFAULT_TRAINING,
        text=hparams.get("text") or DEFAULT_TRAINING,
        embed_dim=hparams.get("embed_dim", 256),
        fusion=hparams.get("fusion") or DEFAULT_FUSION,
        itm=float(objective.get("itm_weight", 1.0)) > 0,
    )
    state = {
        k[len(CHECKPOINT_PREFIX) :]: v
        for k, v in checkpoint["state_dict"].items()
        if k.startswith(CHECKPOINT_PREFIX)
    }
    model.load_state_dict(state)
    if model.image_config.adapter is not None or model.text_config.adapter is not None:
        from mm_lightning.models.adapters import merge_adapters

        merge_adapters(model)  # plain towers with the adapted weights, as export and inference want them
    return model
