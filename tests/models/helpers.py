"""Tiny offline models and synthetic batches for the model tests.

A model is described by plain data, as a config file describes it: the parts (``image_tower``, ``text_tower``,
``loss``) as ``{"class_path": ..., "init_args": {...}}`` dicts, the option groups (``image``, ``text``,
``objective``, ``optim``, ...) as dicts. :func:`tiny_config` merges overrides into such a description;
:func:`module_kwargs` turns one into ``MultimodalModule``'s arguments, building fresh parts on every call
(so two modules never share a tower, and ``torch.manual_seed`` before the call fixes their initialization).
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from mm_lightning.models import MultimodalModule
from mm_lightning.models.config import PARTS
from mm_lightning.models.rules import RULES

VOCAB = 36  # the demo BERT's vocabulary size
TORCHVISION_TOWER = "mm_lightning.models.towers.TorchvisionTower"
HF_TEXT_TOWER = "mm_lightning.models.towers.HFTextTower"

TINY_MODEL: dict[str, Any] = dict(
    image_tower={
        "class_path": TORCHVISION_TOWER,
        "init_args": {
            "name": "resnet_custom",
            "kwargs": {"widths": [8, 16], "layers": [1, 1]},
            "image_size": 32,
        },
    },
    text_tower={
        "class_path": HF_TEXT_TOWER,
        "init_args": {
            "name": "mm-lightning/demo-bert",
            "pretrained": False,
            "config_overrides": {
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 64,
            },
        },
    },
    embed_dim=16,
    fusion={"heads": 2},
    optim={"lr": 1e-3},
)


def tiny_config(base: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """``base`` (default: TINY_MODEL) with ``overrides`` merged in (plain data; see :func:`module_kwargs`).

    * an option group's dict is merged into the group (``optim={"lr": 1e-2}``, ``objective={...}``);
    * a part's dict without ``class_path`` is merged into the part's ``init_args``
      (``image_tower={"image_size": 40}``, ``text_tower={"pooling": "mean"}``);
    * anything else replaces the entry (a part's full ``{"class_path": ..., "init_args": ...}``, a value).
    Merging is one level deep: a dict inside a group or ``init_args`` (``kwargs``, ``config_overrides``) is
    replaced whole.
    """
    config = dict(TINY_MODEL if base is None else base)
    for key, value in overrides.items():
        current = config.get(key)
        if key in PARTS and isinstance(value, dict) and "class_path" not in value:
            if not isinstance(current, dict) or "class_path" not in current:
                raise ValueError(f"{key}: no class_path to merge {sorted(value)} into; give the whole part")
            config[key] = {**current, "init_args": {**current.get("init_args", {}), **value}}
        elif key not in PARTS and isinstance(current, dict) and isinstance(value, dict):
            config[key] = current | value
        else:
            config[key] = value
    return config


# deterministic across batch and process layouts: no BatchNorm (ViT), no dropout
EXACT_MODEL = tiny_config(
    image_tower={
        "name": "vit_custom",
        "kwargs": {"patch_size": 8, "num_layers": 1, "num_heads": 2, "hidden_dim": 16, "mlp_dim": 32},
    },
    text_tower={
        "config_overrides": TINY_MODEL["text_tower"]["init_args"]["config_overrides"]
        | {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    },
)


def build_part(spec: dict[str, Any] | Any) -> Any:
    """The object a ``{"class_path": ..., "init_args": ...}`` dict names, newly built (an object is kept)."""
    if not isinstance(spec, dict):
        return spec
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**copy.deepcopy(spec.get("init_args") or {}))


def module_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``MultimodalModule``'s arguments from a description: its parts and rules built now, fresh."""
    return {
        key: build_part(value) if key in (*PARTS, *RULES) and value is not None else value
        for key, value in config.items()
    }


def gradient_caching(chunks: int) -> dict[str, Any] | None:
    """``model.batch_embedding`` for ``chunks`` chunks with gradient caching (1: none, the whole batch)."""
    if chunks == 1:
        return None
    return {"class_path": "mm_lightning.extras.GradientCaching", "init_args": {"chunks": chunks}}


def tiny_kwargs(base: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """``module_kwargs(tiny_config(base, **overrides))``: for ``MultimodalModule(**...)`` or a subclass."""
    return module_kwargs(tiny_config(base, **overrides))


def tiny_parts(base: dict[str, Any] | None = None, **overrides: Any) -> dict[str, nn.Module]:
    """Only the parts of :func:`tiny_kwargs`: what ``load_from_checkpoint`` needs for a module built in Python
    (its checkpoint records the option groups, not the parts)."""
    config = tiny_config(base, **overrides)
    return {key: build_part(config[key]) for key in PARTS if config.get(key) is not None}


def tiny_module(**overrides: Any) -> MultimodalModule:
    return MultimodalModule(**tiny_kwargs(**overrides))


def cli_module(config: dict[str, Any], root: Path) -> MultimodalModule:
    """The module ``config`` describes, built through the command line (``cli_main(run=False)``), so that its
    checkpoints record every part's ``class_path`` + ``init_args`` as a training run's do.

    Options the description leaves out keep ``MultimodalModule``'s defaults, as from Python. Writes only
    ``root/cli.yaml``; the CLI does not seed (``seed_everything: false``).
    """
    from mm_lightning.cli import cli_main

    root.mkdir(parents=True, exist_ok=True)
    path = root / "cli.yaml"
    path.write_text(  # JSON is YAML
        json.dumps(
            {
                "seed_everything": False,
                "trainer": {"accelerator": "cpu", "devices": 1, "default_root_dir": str(root)},
                "model": config,
                "data": {
                    "class_path": "mm_lightning.data.DemoDataModule",
                    "init_args": {"data_dir": str(root / "demo"), "num_workers": 0},
                },
            }
        )
    )
    return cli_main(["--config", str(path)], run=False).model


def save_checkpoint(model: MultimodalModule, path: Path) -> None:
    """A Lightning checkpoint of ``model`` (as ``trainer.save_checkpoint`` writes it), without training."""
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)


def make_batch(
    size: int = 6, length: int = 7, image_size: int = 32, seed: int = 0, captions_per_image: int = 1
) -> dict[str, Tensor]:
    """Random normalized images and token ids; consecutive rows share an image when captions_per_image > 1."""
    g = torch.Generator().manual_seed(seed)
    image_id = torch.arange(size) // captions_per_image
    distinct = torch.randn(int(image_id.max()) + 1, 3, image_size, image_size, generator=g)
    lengths = torch.randint(3, length + 1, (size,), generator=g)
    lengths[0] = length
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(7, VOCAB, (size, length), generator=g) * attention_mask
    input_ids[:, 0] = 2  # [CLS]
    return {
        "image": distinct[image_id],
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "image_id": image_id,
        "index": torch.arange(size),
    }


class PairDataset(Dataset):
    """Learnable synthetic pairs: class k is a colour (image) and a word (caption token 1)."""

    def __init__(
        self, size: int = 48, classes: int = 8, image_size: int = 32, length: int = 6, seed: int = 0
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(size) % classes
        palette = torch.randn(classes, 3, 1, 1, generator=g)
        self.images = palette[self.labels] + 0.1 * torch.randn(size, 3, image_size, image_size, generator=g)
        self.input_ids = torch.randint(7 + classes, VOCAB, (size, length), generator=g)
        self.input_ids[:, 0] = 2
        self.input_ids[:, 1] = 7 + self.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {
            "image": self.images[i],
            "input_ids": self.input_ids[i],
            "attention_mask": torch.ones_like(self.input_ids[i]),
            "image_id": self.labels[i],  # same class = same image for the metrics
            "index": torch.tensor(i),
        }


def pair_loader(batch_size: int = 8, **kwargs: Any) -> DataLoader:
    return DataLoader(PairDataset(**kwargs), batch_size=batch_size, shuffle=False, num_workers=0)
