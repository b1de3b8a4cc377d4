"""The shipped recipes against the baseline a reviewer writes first, on real photos: test retrieval both ways.

Baseline: both towers of the recipe frozen, their features computed once (the evaluation crop), two linear
projections (to 256 dimensions) and the CLIP temperature trained with the contrastive loss on the whole training
set as one batch (AdamW), from 5 initializations; the step and the initialization are picked on validation
text-to-image R@1. Each recipe (``configs/<name>.yaml``: its model, optimizer, trainer
and data options) trains on the same files, same towers and image size, its checkpoint picked on validation
``val/r1_t2i``. Both are scored on the test split under the multi-caption protocol (``mm_lightning.evaluation.metrics``).
Each run has a process of its own, so its peak memory (resident set) is its own; the table also gives the
trainable parameters and the wall time.

    python benchmarks/recipes.py                                # the dev set (../shared/devdata/coco_mini)
    python benchmarks/recipes.py --data DIR                     # DIR/{train,val,test}.jsonl of your own
    python benchmarks/recipes.py --recipes lit lora --folds 5   # 5-fold cross-validation over all the images
    python benchmarks/recipes.py --recipes lit --epochs 15      # more epochs than the recipe's own
    python benchmarks/recipes.py --recipes lit finetune --curves docs/recipes.png
    python benchmarks/recipes.py --quick                        # 16 small real photos, 32 px, one epoch: seconds

The dev set (239 COCO-2017 photos x 5 human captions) is re-split by image with a fixed seed into
150 train / 30 val / 59 test under ``benchmarks/_cache/`` (the photos stay where they are). A test split that small
cannot rank recipes (R@1 moves in steps of 0.017): ``--folds K`` pools every image (the dev set's, or DIR's three
files), deals them into K test folds and runs everything once per fold, each time on the other images (30 of them
for validation); the table gives each figure's mean and standard deviation over the folds. The last line is
``RESULT recipes ratio=<best recipe's R@1 / the baseline's, the worse of the two directions>`` (means over the folds),
the baseline's R@1 being the best test figure any of its initializations reached (conservative: the table shows the
one validation picked). A second table gives each figure with its 95 % bootstrap interval over the test images of
every fold together, and each recipe against the baseline on the same images: the paired difference, its interval
and the share of resamples where the recipe leads (``mm_lightning.evaluation.intervals``, as ``evaluate`` does).

``--quick`` checks the script end to end without the dev set: 16 JPEGs cut from the photographs that ship with
scikit-image (``benchmarks/support/real_photos.py``), split 8 / 4 / 4 as the dev set is, at 32 px for one epoch, with every
file in a fresh temporary folder, removed at the end; options given beside it still apply (``--folds 2``, say).
"""

from __future__ import annotations

import argparse
import atexit
import copy
import dataclasses
import json
import random
import resource
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from mm_lightning.cli import MultimodalCLI, cli_main
from mm_lightning.commands.evaluate import RETRIEVAL, figures_of, retrieval_queries
from mm_lightning.data import MultimodalDataModule
from mm_lightning.evaluation.intervals import Bootstrap, Figures, intervals, paired_differences
from mm_lightning.evaluation.metrics import RetrievalMetrics, retrieval_metrics
from mm_lightning.models import MultimodalModule
from mm_lightning.models.losses import ContrastiveLoss

REPO = Path(__file__).resolve().parents[1]
DEV_SET = REPO.parent / "shared" / "devdata" / "coco_mini"
CACHE = REPO / "benchmarks" / "_cache"
SPLIT_SIZES = {"train": 150, "val": 30}  # the rest is test
QUICK_SPLIT = {"train": 8, "val": 4}  # of a --quick run's 16 photos
KS = (1, 5, 10)


def dev_records(source: Path) -> list[dict[str, Any]]:
    """The dev set's records (absolute image paths, every caption), in file order."""
    records = []
    for file in sorted(source.glob("*.jsonl")):
        if file.stem.endswith("_pairs"):
            continue
        for line in file.read_text().splitlines():
            record = json.loads(line)
            captions = record.get("captions") or record["text"]  # the dev set's list, or a caption or list
            captions = captions if isinstance(captions, list) else [captions]
            records.append({"image": str((source / record["image"]).resolve()), "text": captions})
    return records


def folder_records(folder: Path) -> list[dict[str, Any]]:
    """``folder``'s train/val/test records, one per image (a caption per line or a list of them), absolute paths."""
    captions: dict[str, list[str]] = {}
    for split in ("train", "val", "test"):
        for line in (folder / f"{split}.jsonl").read_text().splitlines():
            record = json.loads(line)
            text = record["text"] if isinstance(record["text"], list) else [record["text"]]
            captions.setdefault(str((folder / record["image"]).resolve()), []).extend(text)
    return [{"image": image, "text": text} for image, text in captions.items()]


def quick_photos(root: Path, count: int) -> Path:
    """A folder of ``count`` small JPEGs cut from real photographs (``real_photos.py``: no download, no dev set),
    5 captions each, in the dev set's layout: a --quick run's data."""
    from support.real_photos import PHOTO_SETS, build

    spec = dataclasses.replace(PHOTO_SETS["coco"], name="photos", size=(160, 120), count=count)
    return build(root, spec).parent


def write_split(out: Path, parts: dict[str, list[dict[str, Any]]]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for split, part in parts.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return out


def split_dev_set(source: Path, out: Path, seed: int = 0, sizes: dict[str, int] = SPLIT_SIZES) -> Path:
    """Re-splits the dev set's records by image into train/val/test JSONL under ``out`` (absolute image paths):
    ``sizes["train"]`` and ``sizes["val"]`` images, the rest test."""
    records = dev_records(source)
    random.Random(seed).shuffle(records)
    train, val = sizes["train"], sizes["val"]
    return write_split(
        out, {"train": records[:train], "val": records[train : train + val], "test": records[train + val :]}
    )


def fold_splits(records: list[dict[str, Any]], folds: int, out: Path, seed: int = 0) -> list[Path]:
    """``folds`` train/val/test splits by image: fold f tests every folds-th image of a seeded shuffle, validates on
    the first 30 of the others (at most a quarter of them) and trains on the rest."""
    records = list(records)
    random.Random(seed).shuffle(records)
    splits = []
    for fold in range(folds):
        rest = [r for i, r in enumerate(records) if i % folds != fold]
        val = min(SPLIT_SIZES["val"], max(1, len(rest) // 4))
        parts = {"train": rest[val:], "val": rest[:val], "test": records[fold::folds]}
        splits.append(write_split(out / f"fold{fold}", parts))
    return splits


def recipe_cli(name: str, data: Path, args: argparse.Namespace, root: Path, *options: str) -> MultimodalCLI:
    """``configs/<name>.yaml`` on the benchmark's files, built (not run) by the CLI as ``fit`` builds it: the
    model, the data module (tokenizer and image preprocessing linked to the towers) and the trainer with the
    recipe's callbacks and TensorBoard logger in the run folder ``root/<name>``; then the benchmark's options,
    ``--set KEY=VALUE`` as ``--KEY=VALUE`` and the caller's ``options``."""
    batch_size = ["--data.init_args.batch_size", str(args.batch_size)] if args.batch_size else []
    epochs = ["--trainer.max_epochs", str(args.epochs)] if args.epochs else []
    return cli_main(
        [
            "--config", str(REPO / "configs" / f"{name}.yaml"),
            *(arg for split in ("train", "val", "test")
              for arg in (f"--data.init_args.{split}_file", str(data / f"{split}.jsonl"))),
            "--data.init_args.num_workers", str(args.workers),
            *batch_size,
            "--model.image_tower.init_args.image_size", str(args.image_size),
            "--trainer.default_root_dir", str(root / name),
            *epochs,
            "--trainer.max_steps", str(args.max_steps),
            "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false",
            "--trainer.num_sanity_val_steps", "0",
            *(f"--{item}" for item in args.set),
            *options,
        ],
        run=False,
    )  # fmt: skip


def best_checkpoint(trainer: Trainer) -> ModelCheckpoint:
    """The recipe's checkpoint callback that keeps the best ``val/r1_t2i``."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.monitor == "val/r1_t2i":
            return callback
    raise SystemExit(
        "the recipe's callbacks keep no checkpoint on val/r1_t2i: nothing to pick the test step on"
    )


def run_recipe(name: str, data: Path, args: argparse.Namespace, root: Path) -> dict[str, float]:
    """Trains ``configs/<name>.yaml`` on ``data``; test metrics of the checkpoint with the best ``val/r1_t2i``."""
    # an earlier run's checkpoints (the run folder's feature cache stays)
    shutil.rmtree(root / name / "checkpoints", ignore_errors=True)
    cli = recipe_cli(name, data, args, root)
    model, dm, trainer = cli.model, cli.datamodule, cli.trainer
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    wall = time.perf_counter() - start
    best = best_checkpoint(trainer).best_model_path or None
    (metrics,) = trainer.test(model, datamodule=dm, ckpt_path=best, verbose=False)
    out = {k.removeprefix("test/"): float(v) for k, v in metrics.items() if k.startswith("test/r")}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    queries = retrieval_queries(
        model.evaluation.last_ranks
    )  # each test query's outcome, as evaluate keeps it
    return {**out, "wall_s": wall, "steps": trainer.global_step, "trainable": trainable, "queries": queries}


@torch.no_grad()
def tower_features(model: MultimodalModule, dm: MultimodalDataModule) -> dict[str, torch.Tensor]:
    """Pooled features of both frozen towers for every (image, caption) row of the data module's test file."""
    rows: dict[str, list[torch.Tensor]] = {"image": [], "text": [], "image_id": [], "index": []}
    network = model.model.eval()
    for batch in dm.test_dataloader():
        batch = dm.normalize_batch(batch)
        rows["image"].append(network.encode_images(batch["image"])[0].pooled)
        rows["text"].append(network.encode_text(batch)[0].pooled)
        rows["image_id"].append(batch["image_id"])
        rows["index"].append(batch["index"])
    return {k: torch.cat(v) for k, v in rows.items()}


def run_baseline(name: str, data: Path, args: argparse.Namespace) -> dict[str, float]:
    """Frozen towers + linear heads trained on the whole training set as one batch (see the module docstring)."""
    no_options = argparse.Namespace(
        **{**vars(args), "set": [], "batch_size": 64}
    )  # the recipe's towers as shipped
    cli = recipe_cli(name, data, no_options, args.runs_dir / "baseline")
    model, dm = cli.model, cli.datamodule
    start = time.perf_counter()
    features = {}
    for split in ("train", "val", "test"):
        # every caption of every image, evaluation crop: the test loader's protocol on each split's file
        dm.files["test"] = str(data / f"{split}.jsonl")
        dm.datasets.pop("test", None)  # the previous split's
        dm.setup("test")
        features[split] = tower_features(model, dm)
    runs = [train_heads(features, args, seed) for seed in range(args.baseline_seeds)]
    best = max(runs, key=lambda run: run["val"]["r1_t2i"])  # the initialization is picked on validation too
    test_r1 = {d: [r["test"][f"r1_{d}"] for r in runs] for d in ("t2i", "i2t")}
    spread = ", ".join(f"{d} {min(values):.3f}-{max(values):.3f}" for d, values in test_r1.items())
    print(
        f"baseline: test R@1 over {len(runs)} initializations of the heads: {spread}; seed {best['seed']} picked"
    )
    wall = time.perf_counter() - start
    # the RESULT ratio is taken against the best test R@1 any initialization reached (each direction): 30
    # validation photos pick an initialization no better than chance, so the conservative figure is the one kept
    best_test = {f"r1_{d}": max(values) for d, values in test_r1.items()}
    return {
        **best["test"],
        "wall_s": wall,
        "steps": args.baseline_steps,
        "trainable": best["trainable"],
        "val": best["val"],
        "best_test": best_test,
        "queries": best["queries"],
    }


def train_heads(
    features: dict[str, dict[str, torch.Tensor]], args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """Linear heads (width ``--baseline_dim``) + the CLIP temperature on the frozen features, one initialization.

    Full-batch AdamW for ``--baseline_steps`` steps; the step with the best validation text-to-image R@1 is kept.
    """
    torch.manual_seed(seed)
    heads = torch.nn.ModuleDict(
        {
            "image": torch.nn.Linear(features["train"]["image"].shape[1], args.baseline_dim),
            "text": torch.nn.Linear(features["train"]["text"].shape[1], args.baseline_dim),
            "loss": ContrastiveLoss(),
        }
    )
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.baseline_lr, weight_decay=0.01)
    train = features["train"]

    def scores(split: str) -> dict[str, float]:
        f = features[split]
        metrics = retrieval_metrics(heads["image"](f["image"]), heads["text"](f["text"]), f["image_id"], KS)
        return {k: float(v) for k, v in metrics.items() if k.startswith("r")}

    best, best_state = -1.0, copy.deepcopy(heads.state_dict())
    for step in range(1, args.baseline_steps + 1):
        loss = heads["loss"](heads["image"](train["image"]), heads["text"](train["text"]), train["image_id"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == args.baseline_steps:
            with torch.no_grad():
                val = scores("val")
            if val["r1_t2i"] > best:  # the recipes' checkpoints are picked on val/r1_t2i too
                best, best_state = val["r1_t2i"], copy.deepcopy(heads.state_dict())
    heads.load_state_dict(best_state)
    trainable = sum(p.numel() for p in heads.parameters() if p.requires_grad)
    with torch.no_grad():
        test = features["test"]
        ranks = RetrievalMetrics(KS)
        ranks.update(heads["image"](test["image"]), test["image_id"], heads["text"](test["text"]), test["image_id"],
                     test["index"])  # fmt: skip
        queries = retrieval_queries(ranks.compute_ranks())
        return {
            "test": scores("test"),
            "val": scores("val"),
            "seed": seed,
            "trainable": trainable,
            "queries": queries,
        }


def draw_curves(logs: Path, out: Path, baseline: dict[str, Any] | None) -> None:
    """Training loss and validation R@1 against the step, from each recipe's TensorBoard events under ``logs``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = ("train/loss", "val/r1_t2i", "val/r1_i2t")
    fig, axes = plt.subplots(1, len(tags), figsize=(14, 3.6))
    for run in sorted(logs.glob("*/version_*")):  # <runs_dir>/<recipe>/version_N
        events = EventAccumulator(str(run))
        events.Reload()
        for ax, tag in zip(axes, tags, strict=True):
            if tag in events.Tags()["scalars"]:
                points = events.Scalars(tag)
                label = f"{run.parent.name} ({run.name})"
                ax.plot([p.step for p in points], [p.value for p in points], marker=".", label=label)
    for ax, tag in zip(axes, tags, strict=True):
        if baseline and tag.startswith("val/"):
            value = baseline["val"][tag.removeprefix("val/")]
            ax.axhline(value, color="gray", linestyle="--", label="baseline (best val)")
        ax.set_title(tag)
        ax.set_xlabel("optimizer step")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"curves: {out}")


def measured(kind: str, name: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run (``kind`` "baseline" on ``name``'s towers, or the recipe ``name``) and its peak resident memory."""
    torch.set_num_threads(args.threads)
    result = (
        run_baseline(name, data, args) if kind == "baseline" else run_recipe(name, data, args, args.runs_dir)
    )
    return {**result, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_alone(kind: str, name: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`measured` in a process of its own, forked from this one (which computes nothing): the peak memory is
    this run's, counting the ~0.5 GB of imports it starts with, not its loader workers."""
    with ProcessPoolExecutor(1, mp_context=get_context("fork")) as pool:
        return pool.submit(measured, kind, name, data, args).result()


RECALLS = [f"r{k}_{d}" for d in ("t2i", "i2t") for k in KS]


def pooled(runs: list[dict[str, Any]]) -> Figures:
    """The figures of every fold's test images together (each image is tested in one fold)."""
    folds = [figures_of(RETRIEVAL, run["queries"]) for run in runs]
    return Figures(
        folds[0].names, *(np.concatenate([getattr(f, part) for f in folds], axis=1) for part in
                          ("numerator", "denominator", "groups"))
    )  # fmt: skip


def uncertainty_table(results: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> None:
    """A figure a row: each run's R@k with its 95 % bootstrap interval over the test images of every fold, and each
    recipe against the baseline on the same images (paired): the difference, its interval, and how often the
    recipe leads."""
    drawn = Bootstrap()
    figures = {name: pooled(runs) for name, runs in results.items()}
    recipes = [name for name in figures if name != "baseline"] if "baseline" in figures else []
    for name in recipes:  # the same queries in each fold
        for recipe, base in zip(results[name], results["baseline"], strict=True):
            for key in ("caption_index", "caption_image_id", "image_id"):
                assert np.array_equal(recipe["queries"][key], base["queries"][key]), key
    bounds = {name: intervals(figure, drawn) for name, figure in figures.items()}
    paired = {name: paired_differences(figures[name], figures["baseline"], drawn) for name in recipes}
    columns = [labels[name] for name in figures] + [f"{labels[name]} - baseline (paired)" for name in recipes]
    print(f"\n95 % bootstrap intervals, {drawn.resamples} resamples of the test images (each with its captions)"
          " pooled over the folds; a paired difference's share is of resamples where the recipe leads:")  # fmt: skip
    print("| figure | " + " | ".join(columns) + " |")
    print("|---" * (1 + len(columns)) + "|")
    for way, direction in (("image", "t2i"), ("text", "i2t")):
        for k in KS:
            key = f"{way}_retrieval_recall@{k}"
            cells = [
                f"{figures[n].values()[key]:.3f} ({bounds[n][key][0]:.3f}-{bounds[n][key][1]:.3f})"
                for n in figures
            ]
            for name in recipes:
                d = paired[name][key]
                low, high = d["interval"]
                cells.append(
                    f"{d['difference']:+.3f} ({low:+.3f} to {high:+.3f}), {100 * d['share_better']:.0f} %"
                )
            print(f"| R@{k} {direction} | " + " | ".join(cells) + " |")


def cell(values: list[float]) -> str:
    """One figure, or its mean and standard deviation over the folds."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def row(label: str, runs: list[dict[str, Any]]) -> str:
    recalls = " | ".join(cell([run[name] for run in runs]) for name in RECALLS)
    wall = statistics.mean(run["wall_s"] for run in runs)
    peak = max(run["peak_rss_mb"] for run in runs)
    return (
        f"| {label} | {recalls} | {wall:.0f} | {runs[0]['steps']} | {runs[0]['trainable']:,} | {peak:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=None, help="folder with train/val/test.jsonl (default: dev set)"
    )
    parser.add_argument("--recipes", nargs="+", default=["lit"], help="configs/<name>.yaml to run")
    parser.add_argument(
        "--folds", type=int, default=1, help="K > 1: K-fold cross-validation over all the images (mean ± std)"
    )
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=None, help="default: each recipe's trainer.max_epochs")
    parser.add_argument("--max_steps", type=int, default=-1, help="cap on a recipe's optimizer steps")
    parser.add_argument("--baseline_steps", type=int, default=600)
    parser.add_argument("--baseline_lr", type=float, default=1e-3)
    parser.add_argument("--baseline_dim", type=int, default=256, help="the baseline heads' output width")
    parser.add_argument(
        "--baseline_seeds",
        type=int,
        default=5,
        help="initializations of the baseline's heads (best on val kept)",
    )
    parser.add_argument("--batch_size", type=int, default=None, help="default: each recipe's data.batch_size")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--runs_dir", type=Path, default=CACHE / "recipes_runs", help="the recipes' checkpoints"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--curves",
        type=Path,
        default=None,
        help="draw the runs' curves (their TensorBoard events in --runs_dir) to a PNG",
    )
    parser.add_argument(
        "--no_baseline", action="store_true", help="run the recipes only (a sweep's candidates)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a fit option, passed as --KEY=VALUE: model.text.lr=1e-5, trainer.callbacks+=..."
                             " (repeatable)")  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="16 small real photos, 32 px, one epoch, in a temporary folder"
    )
    args = parser.parse_args()
    source, cache, sizes = DEV_SET, CACHE, SPLIT_SIZES
    if args.quick:
        cache = Path(tempfile.mkdtemp(prefix="recipes_quick_"))
        atexit.register(shutil.rmtree, cache, ignore_errors=True)  # a checkpoint holds both towers
        source, sizes = quick_photos(cache, 16), QUICK_SPLIT
        parser.set_defaults(image_size=32, epochs=1, baseline_steps=4, batch_size=4, workers=0,
                            runs_dir=cache / "recipes_runs")  # fmt: skip
        args = parser.parse_args()  # the options given still win
    if args.folds < 1:
        parser.error("--folds must be 1 (the fixed split) or more")
    if args.folds > 1:
        records = folder_records(args.data) if args.data else dev_records(source)
        if args.folds > len(records) // 2:
            parser.error(
                f"--folds {args.folds}: {len(records)} images give at most {len(records) // 2} folds"
            )
        splits = fold_splits(records, args.folds, args.runs_dir / f"folds{args.folds}")
    else:
        splits = [args.data or split_dev_set(source, cache / "coco_mini_split", sizes=sizes)]
    kinds = ([] if args.no_baseline else [("baseline", args.recipes[0])]) + [
        ("recipe", n) for n in args.recipes
    ]
    results: dict[str, list[dict[str, Any]]] = {
        name if kind == "recipe" else kind: [] for kind, name in kinds
    }
    for data in splits:
        counts = {s: sum(1 for _ in (data / f"{s}.jsonl").open()) for s in ("train", "val", "test")}
        print(f"data {data}: images train {counts['train']}, val {counts['val']}, test {counts['test']}")
        for kind, name in kinds:
            run = run_alone(kind, name, data, args)
            results[name if kind == "recipe" else kind].append(run)
            print(
                f"  {name if kind == 'recipe' else kind}: test R@1 {run['r1_t2i']:.3f} / {run['r1_i2t']:.3f}"
            )
    header = " | ".join(f"R@{k} {d}" for d in ("t2i", "i2t") for k in KS)
    print(f"| run | {header} | wall s | steps | trainable | peak RSS MB |")
    print("|---" * (2 + 2 * len(KS) + 3) + "|")
    labels = {"baseline": f"frozen towers + linear heads ({args.recipes[0]}'s towers)"}
    labels |= {name: " ".join([f"configs/{name}.yaml", *args.set]) for name in args.recipes}
    for name, runs in results.items():
        print(row(labels[name], runs))
    uncertainty_table(results, labels)
    if args.curves:
        draw_curves(args.runs_dir, args.curves, results.get("baseline", [None])[-1])
    if "baseline" not in results:
        return
    base = {
        f"r1_{d}": statistics.mean(run["best_test"][f"r1_{d}"] for run in results["baseline"])
        for d in ("t2i", "i2t")
    }
    means = {
        name: {d: statistics.mean(run[f"r1_{d}"] for run in results[name]) for d in ("t2i", "i2t")}
        for name in args.recipes
    }
    ratios = {
        name: min(means[name][d] / max(base[f"r1_{d}"], 1e-9) for d in ("t2i", "i2t"))
        for name in args.recipes
    }
    best = max(ratios, key=ratios.get)
    where = f"{len(splits)} folds of {data.parent}" if len(splits) > 1 else str(data)
    print(
        f"RESULT recipes ratio={ratios[best]:.3f} (best recipe {best}: test R@1 t2i {means[best]['t2i']:.3f} "
        f"i2t {means[best]['i2t']:.3f} vs the baseline's best initialization on test {base['r1_t2i']:.3f} / "
        f"{base['r1_i2t']:.3f}; {counts['test']} test images per split, {args.image_size} px, {where})"
    )


if __name__ == "__main__":
    main()
