"""Tiny random CLIP / SigLIP directories written with save_pretrained (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as hf

TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99)
VISION = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    image_size=32,
    patch_size=8,
)


def save_tiny(kind: str, path: Path, seed: int = 0) -> hf.PreTrainedModel:
    """Writes a tiny random ``CLIPModel`` (``kind="clip"``) or ``SiglipModel`` to ``path`` and returns it."""
    torch.manual_seed(seed)
    if kind == "clip":
        config = hf.CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=16)
        model = hf.CLIPModel(config)
    else:
        model = hf.SiglipModel(hf.SiglipConfig(text_config=TEXT, vision_config=VISION))
    with torch.no_grad():  # a distinctive learned temperature (and bias) to check they are taken over
        model.logit_scale.fill_(2.0 + seed)
        if getattr(model, "logit_bias", None) is not None:
            model.logit_bias.fill_(-3.0 - seed)
    model.eval().save_pretrained(path)
    hf.CLIPImageProcessor(
        image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.25, 0.3], size={"shortest_edge": 32}, crop_size=32
    ).save_pretrained(path)
    return model
