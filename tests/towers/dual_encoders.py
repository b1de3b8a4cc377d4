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


def save_tiny(kind: str, path: Path, seed: int = 0, tokenizer: bool = False) -> hf.PreTrainedModel:
    """Writes a tiny random ``CLIPModel`` (``kind="clip"``) or ``SiglipModel`` to ``path`` and returns it.

    With ``tokenizer``, a real CLIP BPE tokenizer (open_clip's vocabulary as a Hugging Face tokenizer) is saved
    too and the text vocabulary is sized for it, so the directory trains through the CLI.
    """
    torch.manual_seed(seed)
    text = dict(TEXT, vocab_size=49408) if tokenizer else TEXT
    if tokenizer:
        from transformers import AutoTokenizer

        from mm_lightning.models.towers.open_clip import hf_tokenizer_dir

        AutoTokenizer.from_pretrained(hf_tokenizer_dir("ViT-B-32")).save_pretrained(path)
    if kind == "clip":
        config = hf.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=16)
        model = hf.CLIPModel(config)
    else:
        model = hf.SiglipModel(hf.SiglipConfig(text_config=text, vision_config=VISION))
    with torch.no_grad():  # a distinctive learned temperature (and bias) to check they are taken over
        model.logit_scale.fill_(2.0 + seed)
        if getattr(model, "logit_bias", None) is not None:
            model.logit_bias.fill_(-3.0 - seed)
    model.eval().save_pretrained(path)
    hf.CLIPImageProcessor(
        image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.25, 0.3], size={"shortest_edge": 32}, crop_size=32
    ).save_pretrained(path)
    return model


OPEN_CLIP_TINY = "mm-test-tiny-clip"
OPEN_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def register_tiny_open_clip(folder: Path) -> str:
    """Registers a tiny open_clip architecture (config file in ``folder``) and returns its name."""
    import json

    import open_clip

    path = folder / f"{OPEN_CLIP_TINY}.json"
    path.write_text(json.dumps(OPEN_CLIP_CONFIG))
    open_clip.add_model_config(path)
    return OPEN_CLIP_TINY


def save_tiny_open_clip(folder: Path, seed: int = 0) -> tuple[str, Path, torch.nn.Module]:
    """A random tiny open_clip model saved as a checkpoint: (architecture name, checkpoint, model)."""
    import open_clip

    name = register_tiny_open_clip(folder)
    torch.manual_seed(seed)
    model = open_clip.create_model(name).eval()
    with torch.no_grad():
        model.logit_scale.fill_(2.0 + seed)
    checkpoint = folder / f"tiny-{seed}.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    return name, checkpoint, model
