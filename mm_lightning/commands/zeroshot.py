"""Zero-shot top-1 / top-5 of a checkpoint on labeled images.

``python -m mm_lightning zeroshot --ckpt_path CKPT --data DIR_OR_JSONL`` (the classifier and metrics:
:mod:`mm_lightning.evaluation.zeroshot`)."""

from __future__ import annotations

import argparse

from mm_lightning.data.transforms import Normalize
from mm_lightning.evaluation.zeroshot import (
    DEFAULT_TEMPLATES,
    classification_metrics,
    evaluate,
    load_labeled_images,
)


def build_parser() -> argparse.ArgumentParser:
    """The command's options (also used by the tests that check the documented commands parse)."""
    parser = argparse.ArgumentParser(
        prog="python -m mm_lightning zeroshot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ckpt_path", required=True)
    parser.add_argument("--data", required=True, help="ImageFolder directory or JSONL of {image, label}")
    parser.add_argument("--classnames", nargs="*", default=None)
    parser.add_argument("--templates", nargs="*", default=list(DEFAULT_TEMPLATES))
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--max_length", type=int, default=77)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m mm_lightning zeroshot --ckpt_path CKPT --data DIR_OR_JSONL [--templates ...]``."""
    from mm_lightning.commands.export import parse_checkpoint_command
    from mm_lightning.data.collate import load_tokenizer

    args, module = parse_checkpoint_command(build_parser(), argv)
    tokenizer = load_tokenizer(module.data_config["text"]["tokenizer"])
    config = module.data_config["image"]
    images = load_labeled_images(args.data, args.classnames)
    metrics = classification_metrics(len(images.classnames))
    scores = evaluate(
        module,
        images,
        args.templates,
        tokenizer,
        Normalize(tuple(config["mean"]), tuple(config["std"])),
        config["input_size"][-1],
        args.max_length,
        args.batch_size,
        metrics,
        interpolation=config.get("interpolation", "bilinear"),
    )
    print(" ".join(f"{k}={float(v):.4f}" for k, v in scores.items()), f"images={len(images.paths)}")
    return 0
