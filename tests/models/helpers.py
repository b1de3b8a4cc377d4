"""Tiny offline models and synthetic batches for the model tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from mm_lightning.models import MultimodalModule

VOCAB = 36  # the demo BERT's vocabulary size
TINY_MODEL: dict[str, Any] = dict(
    image={"name": "resnet_custom", "kwargs": {"widths": [8, 16], "layers": [1, 1]}, "image_size": 32},
    text={
        "name": "mm-lightning/demo-bert",
        "pretrained": False,
        "config_overrides": {
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        },
    },
    embed_dim=16,
    fusion={"heads": 2},
    optim={"lr": 1e-3},
)


def tiny_config(base: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """``base`` (default: TINY_MODEL) with ``overrides`` merged into its groups (``optim={"lr": 1e-2}``)."""
    config = dict(TINY_MODEL if base is None else base)
    for key, value in overrides.items():
        group = config.get(key)
        config[key] = group | value if isinstance(group, dict) and isinstance(value, dict) else value
    return config


# deterministic across batch and process layouts: no BatchNorm (ViT), no dropout
EXACT_MODEL = tiny_config(
    image={
        "name": "vit_custom",
        "kwargs": {"patch_size": 8, "num_layers": 1, "num_heads": 2, "hidden_dim": 16, "mlp_dim": 32},
    },
    text={
        "config_overrides": TINY_MODEL["text"]["config_overrides"]
        | {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    },
)


def tiny_module(**overrides: Any) -> MultimodalModule:
    return MultimodalModule(**tiny_config(**overrides))


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
