"""``evaluate``: a checkpoint scored on the data's test split (and labeled images) under CLIP_benchmark's protocol.

Retrieval: a caption finds its image if that image is among the top k; an image finds its captions if any of them
is. CLIP_benchmark names them by what is retrieved: ``image_retrieval_recall@k`` is text -> image,
``text_retrieval_recall@k`` image -> text. Ranks start at 1; a tie counts against the query (CLIP_benchmark's
``topk`` breaks it by position: the same figures whenever scores do not tie). Zero-shot classification: ``acc1``,
``acc5`` and ``mean_per_class_recall`` of a classifier built from class names and prompt templates.

Each task is written in CLIP_benchmark's result layout (``<output>/<dataset>_<task>.json``; ``clip_benchmark build``
reads it), and all of them as ``<output>/results.md``. Beside CLIP_benchmark's keys, each figure gets a bootstrap
interval over the test images (``intervals``, drawn as ``bootstrap`` says; see
:mod:`mm_lightning.evaluation.intervals`), and each query's outcome is kept in ``<dataset>_<task>.queries.npz``, so
that a later evaluation of another checkpoint on the same test set can be compared with this one
(``--compare_to``): the difference of each figure, its interval over the same resampled images, and how often
each checkpoint came out ahead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import LightningDataModule, LightningModule, Trainer

from mm_lightning import ExplainedError
from mm_lightning.checkpoints.files import sha256_of
from mm_lightning.checkpoints.run_folder import RUN_DATA_OPTIONS, RunDataOptions, flattened
from mm_lightning.evaluation.intervals import (
    CLASSIFICATION_UNIT,
    HOLM_RULE,
    RETRIEVAL_UNIT,
    Bootstrap,
    Figures,
    classification_figures,
    holm_step_down,
    intervals,
    paired_differences,
    paired_p_values,
    retrieval_figures,
)
from mm_lightning.evaluation.metrics import DEFAULT_KS, Ranks

RETRIEVAL = "zeroshot_retrieval"
CLASSIFICATION = "zeroshot_classification"
# prompt template sets by name (CLIP's: one per line of the paper's ImageNet prompt-ensembling list)
TEMPLATE_SETS = {"openai": "openai_imagenet_templates.json"}


class NoTestSplit(ExplainedError, ValueError):
    """``evaluate`` has no test split to score: none was given, or it gave no batch."""


class NotComparable(ExplainedError, ValueError):
    """``--compare_to`` names a folder whose evaluation cannot be paired with this one's."""


# what a queries file holds per task: the arrays that say who the queries are, then their outcomes (and
# ``source``, a digest of the test set they were read from)
QUERY_KEYS = {
    RETRIEVAL: (("caption_index", "caption_image_id", "image_id"), ("t2i_rank", "i2t_rank")),
    CLASSIFICATION: (("index", "label"), ()),  # and acc<k> per top-k accuracy
}


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
        " model.reranker)",
    )
    parser.add_argument(
        "--bootstrap_resamples",
        type=int,
        default=1000,
        help="resamples of the test images behind each figure's interval (0: no intervals)",
    )
    parser.add_argument("--bootstrap_seed", type=int, default=0, help="seed of the resamples")
    parser.add_argument("--confidence", type=float, default=0.95, help="confidence level of the intervals")
    parser.add_argument(
        "--compare_to",
        help="output folder of an earlier evaluate on the same test set: each figure's difference from it, with"
        " a paired bootstrap interval",
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
    if options.bootstrap_resamples < 0:
        parser.error("--bootstrap_resamples must be 0 (no intervals) or more")
    if options.compare_to is not None and options.bootstrap_resamples < 1:
        parser.error("--compare_to needs --bootstrap_resamples of at least 1")
    if not 0 < options.confidence < 1:
        parser.error(f"--confidence must lie strictly between 0 and 1, not {options.confidence}")

    class EvaluateCLI(MultimodalCLI):
        """``test``'s options and checkpoint handling; the run scores and writes the results."""

        def test(
            self, model: LightningModule, datamodule: LightningDataModule, ckpt_path: str | None, **_: Any
        ) -> None:
            run_evaluation(self.trainer, model, datamodule, ckpt_path, options, self.run_data_options)

    cli_main(["test", *test_args], cli_class=EvaluateCLI)
    return 0


def run_evaluation(
    trainer: Trainer,
    model: LightningModule,
    datamodule: LightningDataModule,
    ckpt_path: str | None,
    options: argparse.Namespace,
    run_data_options: RunDataOptions | None = None,
) -> dict[str, dict[str, Any]]:
    """Tests ``model`` on the data's test split (with zero-shot classification when ``options.zeroshot`` is
    given) and, on rank 0, writes the results; returns them by file name. ``run_data_options``: what the CLI
    did with the checkpoint's data options (the results record it)."""
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
        classifier = ZeroShotEvaluation(name, options.zeroshot, classnames, templates, per_image=True)
        trainer.callbacks.append(classifier)
    if options.rerank_k is not None:  # else the checkpoint's model.reranker
        from mm_lightning.evaluation.rerank import Reranker
        from mm_lightning.evaluation.validation import Evaluation

        model.evaluation = Evaluation(Reranker(options.rerank_k) if options.rerank_k else None)
    test_source = getattr(datamodule, "files", {}).get("test") or "test"
    dataset = options.dataset_name or Path(str(test_source)).stem
    if options.compare_to is not None and trainer.is_global_zero:  # before the test, not after it
        check_baseline_folder(Path(options.compare_to), f"{dataset}_{RETRIEVAL}.json")
    trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
    ranks = model.evaluation.last_ranks if model.evaluation is not None else None
    if ranks is None:
        raise NoTestSplit("evaluate: the test split gave no batch (is --trainer.limit_test_batches 0?)")
    checkpoint = str(trainer.ckpt_path or ckpt_path or "")  # the checkpoint file it resolved to
    dump = {
        "dataset": dataset,
        "model": type(model.model.image_encoder).__name__ + " + " + type(model.model.text_encoder).__name__,
        "pretrained": checkpoint,
        "checkpoint_sha256": sha256_of(checkpoint) if os.path.exists(checkpoint) else None,
        "task": RETRIEVAL,
        "metrics": clip_benchmark_retrieval(ranks),
        "language": "en",
        "images": int(ranks.i2t.numel()),
        "captions": int(ranks.t2i.numel()),
    }
    source = test_set_digest(datamodule)
    skipped = skips_of_test_split(datamodule)
    # the records both evaluations skipped must be the same for a comparison (file:line of each)
    identity = {"source": np.array(source), "skipped": np.array(skipped.pop("records"), dtype=str)}
    reasons = skipped.pop("reasons")
    dump["skipped"] = skipped | {"reasons_file": f"{dataset}_skipped.txt" if reasons else None}
    results = {f"{dump['dataset']}_{RETRIEVAL}.json": dump}
    queries = {f"{dump['dataset']}_{RETRIEVAL}.json": retrieval_queries(ranks) | identity}
    dump["protocol"] = protocol_of(
        datamodule, source, queries[f"{dump['dataset']}_{RETRIEVAL}.json"], run_data_options
    )
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
        queries[f"{name}_{RETRIEVAL}.json"] = retrieval_queries(reranked) | identity
    if classifier is not None:
        zs_dump = {**dump, "dataset": classifier.name, "task": CLASSIFICATION, "metrics": classifier.scores}
        zs_dump.update(images=len(classifier.images.paths), classes=len(classifier.images.classnames))
        del (
            zs_dump["captions"],
            zs_dump["protocol"],
            zs_dump["skipped"],
        )  # the test split's, not the labeled images'
        results[f"{classifier.name}_{CLASSIFICATION}.json"] = zs_dump
        outcomes = {key: value.cpu().numpy() for key, value in classifier.last_outcomes.items()}
        queries[f"{classifier.name}_{CLASSIFICATION}.json"] = outcomes | {
            "source": np.array(labeled_images_digest(options.zeroshot, classifier.images))
        }
    if not trainer.is_global_zero:  # the figures are the same on every rank: rank 0 reports them
        return results
    try:
        if options.bootstrap_resamples:
            bootstrap = Bootstrap(options.bootstrap_resamples, options.bootstrap_seed, options.confidence)
            add_intervals(results, queries, bootstrap)
            if options.compare_to is not None:
                add_comparisons(results, queries, Path(options.compare_to), bootstrap)
    finally:  # a comparison that fails leaves the evaluation's own results written
        write_results(Path(options.output), results, queries)
        if reasons:
            reasons_file = Path(options.output) / dump["skipped"]["reasons_file"]
            reasons_file.write_text("".join(f"{reason}\n" for reason in reasons), encoding="utf-8")
    return results


def skips_of_test_split(datamodule: LightningDataModule) -> dict[str, Any]:
    """The test split's skipped records (``count``, ``by_kind``, ``records``, ``reasons``), over all processes."""
    skipped = getattr(datamodule, "skipped", None)
    if skipped is None:  # a data module of another kind: it counts no skips
        return {"count": 0, "by_kind": {}, "records": [], "reasons": []}
    return skipped.report("test")


def protocol_of(
    datamodule: LightningDataModule,
    source: str,
    queries: dict[str, np.ndarray],
    run_options: RunDataOptions | None,
) -> dict[str, Any]:
    """What decided the scores: the test set, captions per image, the tokenizer, image preparation and the data
    options of :data:`RUN_DATA_OPTIONS`; which of those came from the run's checkpoint in place of the config's
    (``from_run``) and which the command line set to other values than the run's (``differs_from_run``)."""
    hparams = dict(getattr(datamodule, "hparams", {}))
    normalize = getattr(datamodule, "normalize", None)
    _, per_image = np.unique(queries["caption_image_id"], return_counts=True)
    run_options = run_options or RunDataOptions()
    options = {key: value for key, value in flattened(hparams).items() if key in RUN_DATA_OPTIONS}
    return {
        "test_file": getattr(datamodule, "files", {}).get("test"),
        "test_file_sha256": source,
        "captions_per_image": {"min": int(per_image.min()), "max": int(per_image.max())},
        "tokenizer": hparams.get("tokenizer"),
        "image_size": getattr(datamodule, "image_size", None),
        "mean": getattr(normalize, "mean", None),
        "std": getattr(normalize, "std", None),
        "data_options": options,
        "from_run": {key: {"config": given, "run": run} for key, (given, run) in run_options.carried.items()},
        "differs_from_run": {
            key: {"used": given, "run": run} for key, (given, run) in run_options.differing.items()
        },
    }


def protocol_lines(protocol: dict[str, Any]) -> list[str]:
    """The protocol in words; an option is marked where it is the run's in place of the config's, or where the
    command line made it differ from the run's."""
    low, high = protocol["captions_per_image"]["min"], protocol["captions_per_image"]["max"]
    options = []
    for key, value in protocol["data_options"].items():
        if key in protocol["from_run"]:
            value = f"{value} (the run's; the config says {protocol['from_run'][key]['config']})"
        elif key in protocol["differs_from_run"]:
            value = f"{value} (**differs from the run's: {protocol['differs_from_run'][key]['run']}**)"
        options.append(f"{key}: {value}")
    return [
        f"test file: {protocol['test_file']} (SHA-256 {protocol['test_file_sha256']}); captions per image:"
        f" {low if low == high else f'{low}-{high}'}; tokenizer: {protocol['tokenizer']}; images:"
        f" {protocol['image_size']} px, mean {protocol['mean']}, std {protocol['std']}",
        "data options: " + ", ".join(options),
    ]


def skipped_line(skipped: dict[str, Any]) -> str:
    """The test records skipped under ``on_bad_record: skip``, in words."""
    if not skipped["count"]:
        return "test records skipped: none"
    kinds = ", ".join(f"{kind} {n}" for kind, n in skipped["by_kind"].items())
    return (
        f"**test records skipped: {skipped['count']}** ({kinds}); every figure leaves them out (the reasons:"
        f" {skipped['reasons_file']})"
    )


def test_set_digest(datamodule: LightningDataModule) -> str:
    """What the test queries were read from: the test file's SHA-256, or that of the test shards' spec."""
    file = getattr(datamodule, "files", {}).get("test")
    if file and os.path.isfile(file):
        return sha256_of(file)
    spec = getattr(datamodule, "shard_specs", {}).get("test")
    return hashlib.sha256(str(spec if spec is not None else file).encode()).hexdigest()


def labeled_images_digest(data: str, images: Any) -> str:
    """The labeled images' SHA-256: each path (relative to the data's folder) with its class name."""
    root = Path(data) if Path(data).is_dir() else Path(data).parent
    digest = hashlib.sha256()
    for path, label in zip(images.paths, images.labels, strict=True):
        digest.update(f"{os.path.relpath(path, root)}\t{images.classnames[label]}\n".encode())
    return digest.hexdigest()


def retrieval_queries(ranks: Ranks) -> dict[str, np.ndarray]:
    """Who each query is (caption: dataset index and image id; image: id) and where its answer ranked."""
    assert (
        ranks.caption_index is not None and ranks.image_ids is not None
    )  # the evaluation's ranks carry both
    image_ids = ranks.image_ids.cpu().numpy()
    return {
        "caption_index": ranks.caption_index.cpu().numpy(),
        "caption_image_id": image_ids[ranks.column.cpu().numpy()],
        "image_id": image_ids,
        "t2i_rank": ranks.t2i.cpu().numpy(),
        "i2t_rank": ranks.i2t.cpu().numpy(),
    }


def figures_of(task: str, queries: dict[str, np.ndarray]) -> Figures:
    """The figures of a task's queries, per resampled unit (an image)."""
    if task == RETRIEVAL:
        column = np.searchsorted(queries["image_id"], queries["caption_image_id"])
        return retrieval_figures(queries["t2i_rank"], queries["i2t_rank"], column)
    accuracies = {key: queries[key] for key in queries if key.startswith("acc")}
    return classification_figures(queries["label"], accuracies)


def add_intervals(
    results: dict[str, dict[str, Any]], queries: dict[str, dict[str, np.ndarray]], bootstrap: Bootstrap
) -> None:
    """Each result's ``intervals`` (``None`` under 2 test images: nothing to resample) and ``bootstrap``."""
    for file_name, dump in results.items():
        figures = figures_of(dump["task"], queries[file_name])
        dump["intervals"] = intervals(figures, bootstrap) if figures.numerator.shape[1] >= 2 else None
        dump["bootstrap"] = bootstrap.record(
            RETRIEVAL_UNIT if dump["task"] == RETRIEVAL else CLASSIFICATION_UNIT
        )


def check_baseline_folder(baseline: Path, retrieval_file: str) -> None:
    """Refuses a ``--compare_to`` folder without the retrieval queries this evaluation will pair with."""
    if not (baseline / queries_file(retrieval_file)).is_file():
        raise NotComparable(
            f"--compare_to {baseline}: no {queries_file(retrieval_file)} there; give the --output folder of an"
            " evaluate of the same test set (with the same --dataset_name)"
        )


def add_comparisons(
    results: dict[str, dict[str, Any]],
    queries: dict[str, dict[str, np.ndarray]],
    baseline: Path,
    bootstrap: Bootstrap,
) -> None:
    """Each result's ``comparison`` with the same task's in ``baseline``: the paired difference of every figure."""
    for file_name, dump in results.items():
        path = baseline / queries_file(file_name)
        if not path.is_file() or dump["intervals"] is None:
            print(f"evaluate: {dump['dataset']} not compared: {path} holds no counterpart" if not path.is_file()
                  else f"evaluate: {dump['dataset']} not compared: under 2 test images", flush=True)  # fmt: skip
            continue
        theirs = read_queries(path, dump["task"])
        ours = queries[file_name]
        # the same test set first, then the records each left out (named), then the same queries
        for key in ("source", "skipped", *QUERY_KEYS[dump["task"]][0]):
            if key == "skipped":
                check_same_skips(path, ours, theirs)
            elif not np.array_equal(ours[key], theirs[key]):
                what = "the test set's digest" if key == "source" else key
                raise NotComparable(
                    f"{path}: scores another test set than this evaluation ({what} differs): a paired comparison"
                    " needs the same queries"
                )
        this, that = figures_of(dump["task"], ours), figures_of(dump["task"], theirs)
        try:
            figures = paired_differences(this, that, bootstrap)
        except ValueError as err:  # e.g. another number of classes, so other top-k figures
            raise NotComparable(f"{path}: {err}") from err
        alpha = 1 - bootstrap.confidence
        p_values = paired_p_values(this, that, bootstrap)
        for name, (adjusted, outside) in holm_step_down(p_values, alpha).items():
            figures[name] |= {"p_value": p_values[name], "p_holm": adjusted, "outside_noise": outside}
        needed = math.ceil(2 * len(figures) / alpha)  # a permutation p-value is at least 2 / (resamples + 1)
        if bootstrap.resamples + 1 < needed:
            print(
                f"evaluate: with {bootstrap.resamples} resamples no figure of {dump['dataset']} can be called a"
                f" difference over {len(figures)} figures; use --bootstrap_resamples {needed} or more",
                flush=True,
            )
        dump["comparison"] = {
            "baseline": {
                "folder": str(baseline),
                **baseline_checkpoint(baseline / file_name),
                "metrics": that.values(),  # from its queries, as the differences are
            },
            "rule": HOLM_RULE.format(n=len(figures), alpha=100 * alpha),
            "figures": figures,
        }


def check_same_skips(path: Path, ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    """Refuses a comparison of evaluations that skipped other test records (their figures cover other
    subsets); a baseline that does not record its skips is compared with a notice."""
    if "skipped" not in ours:
        return
    if "skipped" not in theirs:
        print(
            f"evaluate: {path} does not record which test records it skipped; compared as if none", flush=True
        )
        theirs = {"skipped": np.array([], dtype=str)}
    if not np.array_equal(np.sort(ours["skipped"]), np.sort(theirs["skipped"])):
        only_ours = sorted(set(ours["skipped"].tolist()) - set(theirs["skipped"].tolist()))
        only_theirs = sorted(set(theirs["skipped"].tolist()) - set(ours["skipped"].tolist()))
        raise NotComparable(
            f"{path}: the two evaluations skipped other test records ({len(ours['skipped'])} here,"
            f" {len(theirs['skipped'])} there; only here: {only_ours[:3]}, only there: {only_theirs[:3]}), so"
            " their figures cover other subsets: fix or remove those records and evaluate both again"
        )


def baseline_checkpoint(result_file: Path) -> dict[str, str | None]:
    """The checkpoint a baseline result names (path and SHA-256), as far as its JSON says; else ``None``."""
    try:
        stored = json.loads(result_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stored = {}
    stored = stored if isinstance(stored, dict) else {}
    return {
        key: stored[key] if isinstance(stored.get(key), str) else None
        for key in ("pretrained", "checkpoint_sha256")
    }


def queries_file(result_file: str) -> str:
    """The queries file beside a result file (not ``.json``: a glob of the results does not pick it up)."""
    return result_file.removesuffix(".json") + ".queries.npz"


def read_queries(path: Path, task: str) -> dict[str, np.ndarray]:
    """A queries file, as data only (no pickled objects), checked to hold the task's arrays of one length each."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            if not isinstance(stored, np.lib.npyio.NpzFile):
                raise ValueError("one array, not a set of named arrays")
            arrays = {key: stored[key] for key in stored.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise NotComparable(f"{path}: not a queries file of evaluate ({err})") from err
    if "source" not in arrays or arrays["source"].shape != () or arrays["source"].dtype.kind != "U":
        raise NotComparable(f"{path}: not a queries file of evaluate (no digest of its test set)")
    identity, outcomes = QUERY_KEYS[task]
    accuracies = [key for key in arrays if key.startswith("acc")] if task == CLASSIFICATION else []
    missing = [key for key in (*identity, *outcomes) if key not in arrays]
    if missing or (task == CLASSIFICATION and "acc1" not in arrays):
        raise NotComparable(
            f"{path}: not a queries file of a {task} evaluation (missing {missing or ['acc1']})"
        )
    for key in (*identity, *outcomes, *accuracies):
        if arrays[key].ndim != 1 or arrays[key].dtype.kind not in "biu":
            raise NotComparable(f"{path}: {key} is not a list of integers")
    if "skipped" in arrays and (arrays["skipped"].ndim != 1 or arrays["skipped"].dtype.kind not in "U"):
        raise NotComparable(f"{path}: skipped is not a list of records")
    lengths = (
        {"captions": ("caption_index", "caption_image_id", "t2i_rank"), "images": ("image_id", "i2t_rank")}
        if task == RETRIEVAL
        else {"images": ("index", "label", *accuracies)}
    )
    for what, keys in lengths.items():
        if len({len(arrays[key]) for key in keys}) != 1:
            raise NotComparable(f"{path}: {', '.join(keys)} give different numbers of {what}")
    if task == RETRIEVAL and not np.isin(arrays["caption_image_id"], arrays["image_id"]).all():
        raise NotComparable(f"{path}: some captions refer to an image that is not among its images")
    return arrays


def write_results(
    folder: Path, results: dict[str, dict[str, Any]], queries: dict[str, dict[str, np.ndarray]]
) -> None:
    """One JSON and one queries file per task, and ``results.md``, a table per task (also printed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, dump in results.items():
        (folder / file_name).write_text(json.dumps(dump, indent=2) + "\n", encoding="utf-8")
        np.savez(folder / queries_file(file_name), **queries[file_name])
    table = markdown_tables(list(results.values()))
    (folder / "results.md").write_text(table, encoding="utf-8")
    print(table + f"\nwritten to {folder}/", flush=True)


def _percent(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.2f}"


def _interval(bounds: list[float] | None) -> str:
    return "n/a" if bounds is None else f"{_percent(bounds[0])}–{_percent(bounds[1])}"


def figure_label(name: str) -> str:
    """A result key in words: ``image_retrieval_recall@1`` is text→image R@1, ``acc5`` top-5."""
    if "_retrieval_recall@" in name:
        way = "text→image" if name.startswith("image") else "image→text"
        return f"{way} R@{name.split('@')[1]}"
    return {"mean_per_class_recall": "mean per-class recall"}.get(name, name.replace("acc", "top-"))


def markdown_tables(dumps: list[dict[str, Any]]) -> str:
    """Retrieval: recall@k (%) and ranks both ways; zero-shot: top-1/top-5 accuracy and mean per-class recall (%);
    first the checkpoint the figures came from, by path and SHA-256; then the intervals and the comparison, if
    the results hold them."""
    tables = [
        f"checkpoint: {path}" + (f" (SHA-256 {sha})" if sha else "")
        for path, sha in dict.fromkeys((d.get("pretrained"), d.get("checkpoint_sha256")) for d in dumps)
        if path
    ]
    protocols = [d for d in dumps if d.get("protocol")]
    if protocols:
        tables.append(
            "\n".join([*protocol_lines(protocols[0]["protocol"]), skipped_line(protocols[0]["skipped"])])
        )
    retrieval = [d for d in dumps if d["task"] == RETRIEVAL]
    if retrieval:
        names = retrieval[0]["metrics"]
        ks = sorted(int(k.split("@")[1]) for k in names if k.startswith("image_retrieval_recall"))
        recall_keys = [f"{what}_retrieval_recall@{k}" for what in ("image", "text") for k in ks]
        recalls = " | ".join(figure_label(key) for key in recall_keys)
        lines = [
            f"| dataset | images | captions | {recalls} | text→image rank (mean / median) |"
            " image→text rank (mean / median) |",
            "|---|---:|---:|" + "---:|" * (2 * len(ks) + 2),
        ]
        for d in retrieval:
            m = d["metrics"]
            cells = [_percent(m[key]) for key in recall_keys]
            for what in ("image", "text"):
                cells.append(
                    f"{m[f'{what}_retrieval_mean_rank']:.1f} / {m[f'{what}_retrieval_median_rank']:g}"
                )
            lines.append(f"| {d['dataset']} | {d['images']} | {d['captions']} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
        tables += interval_table(retrieval, recall_keys)
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
        tables += interval_table(classification, ["acc1", "acc5", "mean_per_class_recall"])
    tables += [comparison_table(d) for d in dumps if "comparison" in d]
    return "\n\n".join(tables) + "\n"


def interval_table(dumps: list[dict[str, Any]], keys: list[str]) -> list[str]:
    """The intervals of ``dumps`` that have them, one row each (none: no table)."""
    dumps = [d for d in dumps if d.get("intervals") is not None]
    if not dumps:
        return []
    drawn = dumps[0]["bootstrap"]
    lines = [
        f"{100 * drawn['confidence']:g} % intervals (%): bootstrap over the test images ({drawn['unit']}),"
        f" {drawn['resamples']} resamples, seed {drawn['seed']}",
        "",
        "| dataset | " + " | ".join(figure_label(key) for key in keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for d in dumps:
        lines.append(
            f"| {d['dataset']} | " + " | ".join(_interval(d["intervals"].get(k)) for k in keys) + " |"
        )
    return ["\n".join(lines)]


def comparison_table(dump: dict[str, Any]) -> str:
    """Each figure of ``dump`` against the baseline's: the difference in points, its paired interval, how often
    this checkpoint came out ahead, its Holm-adjusted p-value; then in words which differences are outside the
    noise by the comparison's rule (over all its figures at once) and which are inside."""
    comparison, confidence = dump["comparison"], dump["bootstrap"]["confidence"]
    baseline = comparison["baseline"]
    lines = [
        f"{dump['dataset']}: this checkpoint against {baseline['pretrained'] or baseline['folder']} on the same"
        f" queries (points; {100 * confidence:g} % paired bootstrap interval; p: paired permutation test,"
        " Holm-adjusted over the figures)",
        "",
        "| figure | this | baseline | difference | interval | this ahead in | baseline ahead in | p (Holm) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    inside, outside = [], []
    for name, figure in comparison["figures"].items():
        low, high = figure["interval"]
        theirs = baseline["metrics"].get(name)
        lines.append(
            f"| {figure_label(name)} | {_percent(dump['metrics'][name])} |"
            f" {'n/a' if theirs is None else _percent(theirs)} | {100 * figure['difference']:+.2f} |"
            f" {100 * low:+.2f} to {100 * high:+.2f} | {100 * figure['share_better']:.1f} % |"
            f" {100 * figure['share_worse']:.1f} % | {figure['p_holm']:.3f} |"
        )
        if figure["outside_noise"]:
            outside.append(f"{figure_label(name)} ({'higher' if figure['difference'] > 0 else 'lower'})")
        else:
            inside.append(figure_label(name))
    words = [
        f"The rule: {comparison['rule']}.",
        f"Outside the noise: {', '.join(outside)}." if outside else "Outside the noise: none.",
        f"Inside the noise (this test set cannot tell the two apart): {', '.join(inside)}." if inside else "",
    ]
    return "\n".join(lines) + "\n\n" + " ".join(w for w in words if w)
