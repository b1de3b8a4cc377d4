"""``evaluate``: a checkpoint scored on the data's test split (and labeled images) under CLIP_benchmark's protocol.

Retrieval: a caption finds its image if that image is among the top k; an image finds its captions if any of them
is. CLIP_benchmark names them by what is retrieved: ``image_retrieval_recall@k`` is text -> image,
``text_retrieval_recall@k`` image -> text. Ranks start at 1; a tie counts against the query (CLIP_benchmark's
``topk`` breaks it by position: the same figures whenever scores do not tie). Zero-shot classification: ``acc1``,
``acc5`` and ``mean_per_class_recall`` of a classifier built from class names and prompt templates.

Each task is written in CLIP_benchmark's result layout (``<output>/<dataset>_<task>.json``; ``clip_benchmark build``
reads it), and all of them as ``<output>/results.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer

from mm_lightning import ExplainedError
from mm_lightning.callbacks.run_report import sha256_of
from mm_lightning.evaluation.metrics import DEFAULT_KS, Ranks

RETRIEVAL = "zeroshot_retrieval"
CLASSIFICATION = "zeroshot_classification"
# prompt template sets by name (CLIP's: one per line of the paper's ImageNet prompt-ensembling list)
TEMPLATE_SETS = {"openai": "openai_imagenet_templates.json"}


class NoTestSplit(ExplainedError, ValueError):
    """``evaluate`` has no test split to score: none was given, or it gave no batch."""


def clip_benchmark_retrieval(ranks: Ranks, ks: tuple[int, ...] = DEFAULT_KS) -> dict[str, float]:
    """Recall@k of both directions under CLIP_benchmark's names, and each direction's mean and median rank."""
    out = {}
    for k in ks:
        out[f"image_retrieval_recall@{k}"] = float((ranks.t2i < k).float().mean())
        out[f"text_retrieval_recall@{k}"] = float((ranks.i2t < k).float().mean())
    for name, rank in (("image_retrieval", ranks.t2i), ("text_retrieval", ranks.i2t)):
        position = rank.double() + 1
        out[f"{name}_mean_rank"] = float(position.mean())
        # numpy's median (the middle two averaged), not torch's (the lower one)
        out[f"{name}_median_rank"] = float(position.quantile(0.5))
    return out


def prompt_templates(templates: list[str] | None) -> list[str]:
    """``None`` or ``["openai"]``: CLIP's 80 ImageNet templates; a ``.json``/``.txt`` file; else the templates."""
    templates = templates or ["openai"]
    if len(templates) == 1 and templates[0] in TEMPLATE_SETS:
        return read_list([str(Path(__file__).parents[1] / "assets" / TEMPLATE_SETS[templates[0]])])
    return read_list(templates)


def read_list(values: list[str]) -> list[str]:
    """The values, or the entries of the one ``.json`` (a list) or ``.txt`` (a line each) file they name."""
    path = Path(values[0]) if len(values) == 1 else None
    if path is None or path.suffix not in (".json", ".txt") or not path.is_file():
        return list(values)
    text = path.read_text(encoding="utf-8")
    return (
        json.loads(text) if path.suffix == ".json" else [line for line in text.splitlines() if line.strip()]
    )


def build_parser() -> argparse.ArgumentParser:
    """The command's own options; every other option is ``test``'s (``--config``, ``--ckpt_path``, ``--data.*``,
    ``--trainer.devices``, ...)."""
    parser = argparse.ArgumentParser(
        prog="python -m mm_lightning evaluate",
        description="Score a checkpoint on the data's test split (and labeled images) under CLIP_benchmark's"
        " protocol. Every option of `python -m mm_lightning test` applies too, e.g. --config, --ckpt_path,"
        " --data.init_args.test_file, --trainer.devices.",
        allow_abbrev=False,
    )
    parser.add_argument("--output", default="evaluation", help="folder of the JSON files and results.md")
    parser.add_argument("--dataset_name", help="name in the results (default: the test file's name)")
    parser.add_argument("--zeroshot", help="labeled images (a folder per class, or a JSONL) to classify too")
    parser.add_argument(
        "--classnames",
        nargs="*",
        help="their class names, or a .json/.txt file of them (default: folder names or JSONL labels)",
    )
    parser.add_argument(
        "--rerank_k",
        type=int,
        help="also re-rank each query's top k with the matching head (0: off; default: the checkpoint's"
        " fusion.rerank_k)",
    )
    parser.add_argument(
        "--templates",
        nargs="*",
        help="prompt templates with {}, a .json/.txt file of them, or openai (default)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m mm_lightning evaluate --config ... --ckpt_path CKPT [--output DIR] [--zeroshot DIR] ...``."""
    from mm_lightning.cli import MultimodalCLI, cli_main

    parser = build_parser()
    options, test_args = parser.parse_known_args(argv)

    class EvaluateCLI(MultimodalCLI):
        """``test``'s options and checkpoint handling; the run scores and writes the results."""

        def test(
            self, model: LightningModule, datamodule: LightningDataModule, ckpt_path: str | None, **_: Any
        ) -> None:
            run_evaluation(self.trainer, model, datamodule, ckpt_path, options)

    cli_main(["test", *test_args], cli_class=EvaluateCLI)
    return 0


def run_evaluation(
    trainer: Trainer,
    model: LightningModule,
    datamodule: LightningDataModule,
    ckpt_path: str | None,
    options: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Tests ``model`` on the data's test split (with zero-shot classification when ``options.zeroshot`` is
    given) and, on rank 0, writes the results; returns them by file name."""
    if not (hasattr(datamodule, "has_split") and datamodule.has_split("test")):
        raise NoTestSplit(
            "evaluate scores the data's test split: give it an image-caption JSONL with --data.init_args.test_file"
            " (or test_shards for shards)"
        )
    classifier = None
    if options.zeroshot is not None:
        from mm_lightning.evaluation.zeroshot import ZeroShotEvaluation

        data = Path(options.zeroshot)
        name = data.stem if data.is_file() else data.name
        templates = prompt_templates(options.templates)
        classnames = read_list(options.classnames) if options.classnames else None
        classifier = ZeroShotEvaluation(name, options.zeroshot, classnames, templates)
        trainer.callbacks.append(classifier)
    if options.rerank_k is not None:  # else the checkpoint's fusion.rerank_k
        from mm_lightning.evaluation.validation import Evaluation

        model.evaluation = Evaluation(options.rerank_k)
    trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
    ranks = model.evaluation.last_ranks if model.evaluation is not None else None
    if ranks is None:
        raise NoTestSplit("evaluate: the test split gave no batch (is --trainer.limit_test_batches 0?)")
    test_source = getattr(datamodule, "files", {}).get("test") or "test"
    checkpoint = str(trainer.ckpt_path or ckpt_path or "")  # the checkpoint file it resolved to
    dump = {
        "dataset": options.dataset_name or Path(str(test_source)).stem,
        "model": type(model.model.image_encoder).__name__ + " + " + type(model.model.text_encoder).__name__,
        "pretrained": checkpoint,
        "checkpoint_sha256": sha256_of(checkpoint) if os.path.isfile(checkpoint) else None,
        "task": RETRIEVAL,
        "metrics": clip_benchmark_retrieval(ranks),
        "language": "en",
        "images": int(ranks.i2t.numel()),
        "captions": int(ranks.t2i.numel()),
    }
    results = {f"{dump['dataset']}_{RETRIEVAL}.json": dump}
    reranked = model.evaluation.last_reranked
    if reranked is not None:
        k = model.evaluation.reranker.k
        name = f"{dump['dataset']}+itm_rerank{k}"
        results[f"{name}_{RETRIEVAL}.json"] = {
            **dump,
            "dataset": name,
            "metrics": clip_benchmark_retrieval(reranked),
            "rerank": {"k": k, "score": "matching head's match logit + cosine similarity"},
        }
    if classifier is not None:
        zs_dump = {**dump, "dataset": classifier.name, "task": CLASSIFICATION, "metrics": classifier.scores}
        zs_dump.update(images=len(classifier.images.paths), classes=len(classifier.images.classnames))
        del zs_dump["captions"]
        results[f"{classifier.name}_{CLASSIFICATION}.json"] = zs_dump
    if trainer.is_global_zero:
        write_results(Path(options.output), results)
    return results


def write_results(folder: Path, results: dict[str, dict[str, Any]]) -> None:
    """One JSON per task and ``results.md``, a table per task (also printed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, dump in results.items():
        (folder / file_name).write_text(json.dumps(dump, indent=2) + "\n", encoding="utf-8")
    table = markdown_tables(list(results.values()))
    (folder / "results.md").write_text(table, encoding="utf-8")
    print(table + f"\nwritten to {folder}/", flush=True)


def _percent(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.2f}"


def markdown_tables(dumps: list[dict[str, Any]]) -> str:
    """Retrieval: recall@k (%) and ranks both ways; zero-shot: top-1/top-5 accuracy and mean per-class recall (%);
    first the checkpoint the figures came from, by path and SHA-256."""
    tables = [
        f"checkpoint: {path}" + (f" (SHA-256 {sha})" if sha else "")
        for path, sha in dict.fromkeys((d.get("pretrained"), d.get("checkpoint_sha256")) for d in dumps)
        if path
    ]
    retrieval = [d for d in dumps if d["task"] == RETRIEVAL]
    if retrieval:
        names = retrieval[0]["metrics"]
        ks = sorted(int(k.split("@")[1]) for k in names if k.startswith("image_retrieval_recall"))
        recalls = " | ".join(f"{way} R@{k}" for way in ("text→image", "image→text") for k in ks)
        lines = [
            f"| dataset | images | captions | {recalls} | text→image rank (mean / median) |"
            " image→text rank (mean / median) |",
            "|---|---:|---:|" + "---:|" * (2 * len(ks) + 2),
        ]
        for d in retrieval:
            m = d["metrics"]
            cells = [_percent(m[f"{what}_retrieval_recall@{k}"]) for what in ("image", "text") for k in ks]
            for what in ("image", "text"):
                cells.append(
                    f"{m[f'{what}_retrieval_mean_rank']:.1f} / {m[f'{what}_retrieval_median_rank']:g}"
                )
            lines.append(f"| {d['dataset']} | {d['images']} | {d['captions']} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    classification = [d for d in dumps if d["task"] == CLASSIFICATION]
    if classification:
        lines = [
            "| dataset | images | classes | top-1 | top-5 | mean per-class recall |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for d in classification:
            m = d["metrics"]
            cells = [_percent(m.get(k, math.nan)) for k in ("acc1", "acc5", "mean_per_class_recall")]
            lines.append(f"| {d['dataset']} | {d['images']} | {d['classes']} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables) + "\n"
