"""Export a trained checkpoint as a Hugging Face model directory that ``transformers`` loads as-is.

    python -m mm_lightning export --ckpt_path logs/finetune_clip/checkpoints/last.ckpt --format hf --out my-clip

A model whose towers came from a ``CLIPModel`` / ``SiglipModel`` directory (``clip:<dir>``) is written back as
that class, fine-tuned towers, projections and logit scale (and bias) included, with the source directory's
tokenizer and image processor, so ``CLIPModel.from_pretrained(out).get_image_features(...)`` gives the
checkpoint's embeddings.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from torch import nn

from mm_lightning.models import MultimodalModule
from mm_lightning.models.towers.clip import CLIPImageTower, CLIPTextTower, load_dual_encoder
from mm_lightning.models.towers.registry import split_name

log = logging.getLogger(__name__)
FORMATS = ("hf",)


def _source_directory(module: MultimodalModule) -> str:
    image, text = module.image_encoder, module.text_encoder
    if not (isinstance(image, CLIPImageTower) and isinstance(text, CLIPTextTower)):
        raise ValueError(
            "export --format hf writes CLIPModel / SiglipModel directories: both towers must come from one "
            f"(clip:<dir>); this checkpoint has {type(image).__name__} + {type(text).__name__}"
        )
    image_dir = split_name(module.hparams["image"]["name"])[1]
    text_dir = split_name(module.hparams["text"]["name"])[1]
    if image_dir != text_dir:
        raise ValueError(f"the towers come from two directories ({image_dir}, {text_dir}); export needs one")
    return image_dir


@torch.no_grad()
def export_hf(module: MultimodalModule, out: str | Path) -> Path:
    """Writes ``module`` as the Hugging Face dual encoder its towers came from, with tokenizer and processor.

    Args:
        module: a trained module whose towers are ``clip:<dir>`` towers of one directory.
        out: output directory (created).

    Returns:
        The output directory.
    """
    source_dir = _source_directory(module)
    target = load_dual_encoder(source_dir, pretrained=False).eval()
    target.vision_model.load_state_dict(module.image_encoder.model.state_dict())
    target.text_model.load_state_dict(module.text_encoder.model.state_dict())
    for name, projection in (("visual_projection", module.image_proj), ("text_projection", module.text_proj)):
        if hasattr(target, name):
            getattr(target, name).load_state_dict(projection.state_dict())
        elif not isinstance(projection, nn.Identity):
            raise ValueError(f"{type(target).__name__} has no {name} to hold the trained projection")
    target.logit_scale.copy_(module.contrastive.logit_scale.detach())
    loss_bias = getattr(module.contrastive, "logit_bias", None)
    if getattr(target, "logit_bias", None) is not None and isinstance(loss_bias, torch.Tensor):
        target.logit_bias.copy_(loss_bias.detach())
    out = Path(out)
    target.save_pretrained(out)
    _copy_preprocessing(source_dir, out)
    return out


def _copy_preprocessing(source_dir: str, out: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    from mm_lightning.assets import resolve_pretrained

    path = resolve_pretrained(source_dir)
    for loader in (AutoTokenizer, AutoImageProcessor):
        try:
            loader.from_pretrained(path).save_pretrained(out)
        except (OSError, ValueError) as err:
            log.warning("%s: no %s to copy (%s)", path, loader.__name__, err)


def main(argv: list[str] | None = None) -> int:
    """``python -m mm_lightning export --ckpt_path CKPT --format hf --out DIR``."""
    parser = argparse.ArgumentParser(
        prog="python -m mm_lightning export", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ckpt_path", required=True, help="Lightning checkpoint of a MultimodalModule")
    parser.add_argument("--format", default="hf", choices=FORMATS, help="output format (default: hf)")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    if not Path(args.ckpt_path).is_file():
        parser.error(f"--ckpt_path {args.ckpt_path!r} does not exist")
    module = MultimodalModule.load_from_checkpoint(args.ckpt_path, map_location="cpu").eval()
    out = export_hf(module, args.out)
    print(f"wrote {out}")
    return 0
