"""Export a trained checkpoint as a Hugging Face model directory that ``transformers`` loads as-is.

    python -m mm_lightning export --ckpt_path logs/run/checkpoints/last.ckpt --format hf --out my-model

Two layouts, picked from the towers:

- both towers from one ``CLIPModel`` / ``SiglipModel`` directory (``CLIPImageTower`` + ``CLIPTextTower``): written
  back as that class,
  fine-tuned towers, projections and logit scale (and bias) included, with the source directory's tokenizer and
  image processor;
- otherwise a ``VisionTextDualEncoderModel``: an image tower from Hugging Face (``HFVisionTower``: ViT, DINOv2,
  CLIP vision, SigLIP vision; or ``CLIPImageTower``) and a Hugging Face text tower (``HFTextTower``: a hub name or
  local directory such as a BERT; or ``CLIPTextTower``), with the module's projections and logit scale.
  The data pipeline's tokenizer and image normalization/size are saved next to it as a
  ``VisionTextDualEncoderProcessor`` (``AutoProcessor.from_pretrained(out)``).

Either way ``get_image_features(...).pooler_output`` / ``get_text_features(...).pooler_output`` of the exported
model equal the checkpoint's projected (pre-normalization) embeddings: export checks this on a small input and
refuses to write otherwise, naming the half that differs. See :mod:`mm_lightning.export_dual_encoder` for how the
projections are expressed in ``VisionTextDualEncoderModel``'s bias-free ones, and what cannot be (text
``pooling: mean``, a DINOv2 tower with a projection bias, timm / torchvision towers).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mm_lightning.callbacks.run_report import sha256_of
from mm_lightning.export_dual_encoder import (
    ExportError,
    build_dual_encoder,
    check_same_embeddings,
    effective_logit_scale,
    save_processor,
)
from mm_lightning.models import DualEncoder
from mm_lightning.models.towers.clip import CLIPImageTower, CLIPTextTower, load_dual_encoder

log = logging.getLogger(__name__)
FORMATS = ("hf",)
SOURCE_FILE = "source_checkpoint.json"  # the checkpoint an export came from, by path and SHA-256
__all__ = ["ExportError", "export_hf", "main"]


def _single_source_directory(module: DualEncoder) -> str | None:
    """The ``CLIPModel`` / ``SiglipModel`` directory both towers came from, or None."""
    image, text = module.image_encoder, module.text_encoder
    if not (isinstance(image, CLIPImageTower) and isinstance(text, CLIPTextTower)):
        return None
    return image.name if image.name == text.name else None


@torch.no_grad()
def export_hf(module: DualEncoder, out: str | Path, data: dict[str, Any] | None = None) -> Path:
    """Writes ``module`` as a Hugging Face dual encoder directory, with tokenizer and image processor.

    Args:
        module: a trained module.
        out: output directory (created).
        data: the data module's hyperparameters the checkpoint was trained with (``mean``, ``std``,
            ``image_size``, ``tokenizer``, ``max_length``); missing keys follow the towers' own preprocessing.

    Returns:
        The output directory.

    Raises:
        ExportError: the towers cannot be expressed in the format, or the exported model's embeddings would
            differ from the checkpoint's (the message says which part and why).
    """
    was_training = module.training
    module.eval()
    try:
        source_dir = _single_source_directory(module)
        if source_dir is not None:
            target = _clip_model(module, source_dir)
        else:
            target = build_dual_encoder(module)
        check_same_embeddings(module, target)
        out = Path(out)
        target.save_pretrained(out)
        if source_dir is not None:
            _copy_preprocessing(source_dir, out)
        else:
            save_processor(module, out, data or {})
    finally:
        module.train(was_training)
    return out


def _clip_model(module: DualEncoder, source_dir: str) -> nn.Module:
    """The source ``CLIPModel`` / ``SiglipModel`` with the module's towers, projections and logit scale/bias."""
    target = load_dual_encoder(source_dir, pretrained=False).eval()
    target.vision_model.load_state_dict(module.image_encoder.model.state_dict())
    target.text_model.load_state_dict(module.text_encoder.model.state_dict())
    for name, projection in (("visual_projection", module.image_proj), ("text_projection", module.text_proj)):
        if hasattr(target, name):
            getattr(target, name).load_state_dict(projection.state_dict())
        elif not isinstance(projection, nn.Identity):
            raise ExportError(f"{type(target).__name__} has no {name} to hold the trained projection")
    target.logit_scale.copy_(effective_logit_scale(module.contrastive))
    loss_bias = getattr(module.contrastive, "logit_bias", None)
    if getattr(target, "logit_bias", None) is not None and isinstance(loss_bias, torch.Tensor):
        target.logit_bias.copy_(loss_bias.detach())
    return target


def _copy_preprocessing(source_dir: str, out: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    from mm_lightning.assets import resolve_pretrained

    path = resolve_pretrained(source_dir)
    for loader in (AutoTokenizer, AutoImageProcessor):
        try:
            loader.from_pretrained(path).save_pretrained(out)
        except (OSError, ValueError) as err:
            log.warning("%s: no %s to copy (%s)", path, loader.__name__, err)


def _data_hyperparameters(checkpoint_path: str) -> dict[str, Any]:
    """The data module's hyperparameters stored in a Lightning checkpoint ({} when it has none)."""
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    return dict(checkpoint.get("datamodule_hyper_parameters") or {})


def build_parser() -> argparse.ArgumentParser:
    """The command's options (also used by the tests that check the documented commands parse)."""
    parser = argparse.ArgumentParser(
        prog="python -m mm_lightning export", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ckpt_path", required=True, help="Lightning checkpoint of a MultimodalModule")
    parser.add_argument("--format", default="hf", choices=FORMATS, help="output format (default: hf)")
    parser.add_argument("--out", required=True, help="output directory")
    return parser


def parse_checkpoint_command(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, DualEncoder]:
    """The options of a command that reads a training checkpoint (``export``, ``zeroshot``), and its network.

    A missing ``--ckpt_path`` file is a usage error naming it (exit code 2).
    """
    args = parser.parse_args(argv)
    if not Path(args.ckpt_path).is_file():
        from mm_lightning.plugins.checkpoint_file import checkpoints_nearby

        # no run config here to find a run's last or best by: the file's path
        parser.error(f"--ckpt_path {args.ckpt_path!r} does not exist; {checkpoints_nearby(None)}")
    return args, DualEncoder.from_checkpoint(args.ckpt_path, map_location="cpu").eval()


def main(argv: list[str] | None = None) -> int:
    """``python -m mm_lightning export --ckpt_path CKPT --format hf --out DIR``."""
    parser = build_parser()
    args, module = parse_checkpoint_command(parser, argv)
    try:
        out = export_hf(module, args.out, _data_hyperparameters(args.ckpt_path))
    except ExportError as error:
        parser.exit(1, f"export: {args.ckpt_path}: {error}\n")
    source = {"checkpoint": str(args.ckpt_path), "checkpoint_sha256": sha256_of(args.ckpt_path)}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out} (from {source['checkpoint']}, SHA-256 {source['checkpoint_sha256']})")
    return 0
