"""Zero-shot classification: class names + prompt templates -> text classifier -> top-1 / top-5 on labeled images.

As a validation/test metric (logged as ``zeroshot/<name>/top1``, ``/top5`` and ``/mean_per_class_recall`` next to
retrieval), add the callback
in a config::

    trainer:
      callbacks+:                          # + adds to the recipe's callbacks
        - class_path: mm_lightning.evaluation.zeroshot.ZeroShotEvaluation
          init_args:
            name: pets
            data: data/pets/val            # ImageFolder layout (one folder per class) or a JSONL of
                                           # {"image": path, "label": class name}
            templates: ["a photo of a {}.", "a blurry photo of a {}."]

As a command: ``python -m mm_lightning zeroshot --ckpt_path last.ckpt --data data/pets/val``.

Each rank scores its share of the images; ``torchmetrics`` sums the counts over ranks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix
from torchmetrics.utilities import dim_zero_cat
from typing_extensions import override

from mm_lightning.data.images import decode_image_file
from mm_lightning.data.transforms import Normalize, eval_transform

DEFAULT_TEMPLATES = ("a photo of a {}.",)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class MeanPerClassRecall(MulticlassConfusionMatrix):
    """Recall averaged over the classes that have images (sklearn's balanced accuracy, as CLIP_benchmark reports;
    torchmetrics' macro recall would count a class without images as 0)."""

    @override
    def compute(self) -> Tensor:
        matrix = super().compute()  # rows: true classes
        support = matrix.sum(1)
        present = support > 0
        return (matrix.diagonal()[present] / support[present]).float().mean()


def accuracy_ks(num_classes: int) -> list[int]:
    """The top-k accuracies CLIP_benchmark reports: top-1, and top-5 from 5 classes on."""
    return [k for k in (1, 5) if k <= num_classes]


class ImageOutcomes(Metric):
    """Each image's label and whether each top-k holds it, over all ranks in image order: what a bootstrap of the
    accuracies resamples."""

    full_state_update = False

    def __init__(self, ks: Sequence[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.ks = list(ks)
        for name in ("index", "label", "hits"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, logits: Tensor, target: Tensor, index: Tensor) -> None:
        top = logits.topk(max(self.ks), dim=1).indices
        self.index.append(index)
        self.label.append(target)
        self.hits.append(torch.stack([(top[:, :k] == target[:, None]).any(1) for k in self.ks], 1))

    def compute(self) -> dict[str, Tensor]:
        """``index`` (sorted), ``label`` and ``acc<k>`` (0/1) per image."""
        index = dim_zero_cat(self.index).long()  # a rank without images holds an empty float state
        order = index.argsort()
        hits = dim_zero_cat(self.hits).bool()[order]
        return {"index": index[order], "label": dim_zero_cat(self.label).long()[order]} | {
            f"acc{k}": hits[:, i] for i, k in enumerate(self.ks)
        }


def classification_metrics(num_classes: int) -> dict[str, Metric]:
    """CLIP_benchmark's: ``acc1``, ``acc5`` (from 5 classes on) and ``mean_per_class_recall`` (balanced accuracy)."""
    ks = accuracy_ks(num_classes)
    metrics: dict[str, Metric] = {
        f"acc{k}": MulticlassAccuracy(num_classes, top_k=k, average="micro") for k in ks
    }
    metrics["mean_per_class_recall"] = MeanPerClassRecall(num_classes)
    return metrics


@dataclass
class LabeledImages:
    """Image paths, their class indices and the class names."""

    paths: list[str]
    labels: list[int]
    classnames: list[str]


def load_labeled_images(data: str, classnames: Sequence[str] | None = None) -> LabeledImages:
    """Reads an ImageFolder-style directory or a JSONL of ``{"image": path, "label": class name or index}``.

    Args:
        data: the directory (one sub-folder per class; folder names are the class names unless ``classnames``
            gives them, in sorted folder order) or the JSONL file (paths relative to its folder).
        classnames: class names (required for integer JSONL labels; otherwise taken from the data).

    Raises:
        ValueError: no images, an unknown label, or a malformed JSONL line (file and line named).
    """
    root = Path(data)
    if root.is_dir():
        folders = sorted(p for p in root.iterdir() if p.is_dir())
        names = list(classnames) if classnames is not None else [f.name.replace("_", " ") for f in folders]
        if len(names) != len(folders):
            raise ValueError(f"{data}: {len(folders)} class folders but {len(names)} class names")
        paths, labels = [], []
        for index, folder in enumerate(folders):
            files = sorted(f for f in folder.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
            paths += [str(f) for f in files]
            labels += [index] * len(files)
    elif root.is_file():
        paths, raw = [], []
        for number, line in enumerate(root.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                paths.append(str(root.parent / record["image"]))
                raw.append(record["label"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{data}:{number}: expected {{'image': ..., 'label': ...}} ({err})") from err
        names = list(classnames) if classnames is not None else sorted({str(r) for r in raw})
        index_of = {n: i for i, n in enumerate(names)}
        labels = []
        for number, label in enumerate(raw, start=1):
            if isinstance(label, int) and 0 <= label < len(names):
                labels.append(label)
            elif str(label) in index_of:
                labels.append(index_of[str(label)])
            else:
                raise ValueError(f"{data}: record {number}: label {label!r} is not one of the class names")
    else:
        raise ValueError(f"zero-shot data {data!r} is neither a directory nor a JSONL file")
    if not paths:
        raise ValueError(f"zero-shot data {data!r} holds no images")
    return LabeledImages(paths, labels, names)


@torch.no_grad()
def class_embeddings(
    module: nn.Module,
    tokenizer: object,
    classnames: Sequence[str],
    templates: Sequence[str],
    max_length: int,
) -> Tensor:
    """(C, D) classifier: per class, the normalized mean of its normalized prompt embeddings (CLIP's recipe).

    ``module``: a :class:`~mm_lightning.models.DualEncoder`.
    """
    device = next(module.parameters()).device
    rows = []
    for name in classnames:
        batch = tokenizer(
            [t.format(name) for t in templates],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        batch = {k: v.to(device) for k, v in batch.items()}
        rows.append(F.normalize(module.embed_text(**batch).mean(0), dim=-1))
    return torch.stack(rows)


class ZeroShotEvaluation(Callback):
    """Zero-shot top-1/top-5 and mean per-class recall on a labeled image set after each validation and test epoch.

    Args:
        name: short name used in the metric keys (``zeroshot/<name>/top1``).
        data: ImageFolder-style directory or JSONL of ``{"image", "label"}`` (see :func:`load_labeled_images`).
        classnames: class names (default: the folder names / JSONL labels).
        templates: prompt templates with one ``{}`` for the class name.
        batch_size: images per forward pass.
        image_size: input side (default: the datamodule's ``image_size``).
        max_images: evaluate on the first N images only (None: all).
        per_image: also keep each image's outcome (``last_outcomes``), for bootstrap intervals.
    """

    def __init__(
        self,
        name: str,
        data: str,
        classnames: list[str] | None = None,
        templates: list[str] | None = None,
        batch_size: int = 64,
        image_size: int | None = None,
        max_images: int | None = None,
        per_image: bool = False,
    ) -> None:
        self.name = name
        self.images = load_labeled_images(data, classnames)
        if max_images is not None:
            self.images.paths, self.images.labels = (
                self.images.paths[:max_images],
                self.images.labels[:max_images],
            )
        self.templates = list(templates or DEFAULT_TEMPLATES)
        if any("{}" not in t for t in self.templates):
            raise ValueError(f"every prompt template needs a '{{}}' for the class name: {self.templates}")
        self.batch_size = batch_size
        self.image_size = image_size
        self.metrics = classification_metrics(len(self.images.classnames))
        self.outcomes = ImageOutcomes(accuracy_ks(len(self.images.classnames))) if per_image else None
        self.scores: dict[str, float] = {}  # the last evaluation's, by CLIP_benchmark's names
        self.last_outcomes: dict[str, Tensor] = {}  # and its per-image outcomes

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._evaluate(trainer, pl_module)

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        data = trainer.datamodule
        hp = data.hparams
        scores = evaluate(
            pl_module.model,
            self.images,
            self.templates,
            data.collate.tokenizer,
            data.normalize,  # the data's own normalization (it may follow the image tower)
            self.image_size or data.image_size,
            hp.max_length,
            self.batch_size,
            self.metrics,
            trainer.global_rank,
            trainer.world_size,
            interpolation=getattr(data, "interpolation", "bilinear"),
            outcomes=self.outcomes,
        )
        self.scores = {key: float(value) for key, value in scores.items()}
        self.last_outcomes = self.outcomes.compute() if self.outcomes is not None else {}
        for key, value in scores.items():
            logged = key.replace("acc", "top") if key.startswith("acc") else key
            pl_module.log(f"zeroshot/{self.name}/{logged}", value, batch_size=len(self.images.paths))


@torch.no_grad()
def evaluate(
    module: nn.Module,
    images: LabeledImages,
    templates: Sequence[str],
    tokenizer: object,
    normalize: Normalize,
    image_size: int,
    max_length: int,
    batch_size: int,
    metrics: dict[str, Metric],
    rank: int = 0,
    world_size: int = 1,
    interpolation: str = "bilinear",
    outcomes: ImageOutcomes | None = None,
) -> dict[str, Tensor]:
    """The ``metrics`` (e.g. :func:`classification_metrics`) of zero-shot classification of a :class:`~mm_lightning.models.DualEncoder`; rank ``r``
    scores images ``r, r + world_size, ...``. ``outcomes``, if given, collects each image's."""
    device = next(module.parameters()).device
    was_training = module.training
    module.eval()
    classifier = class_embeddings(module, tokenizer, images.classnames, templates, max_length)
    resize, normalize = eval_transform(image_size, interpolation=interpolation), normalize.to(device)
    mine = list(range(rank, len(images.paths), world_size))
    for metric in [*metrics.values(), *([outcomes] if outcomes is not None else [])]:
        metric.to(device).reset()
    for start in range(0, len(mine), batch_size):
        chunk = mine[start : start + batch_size]
        batch = torch.stack([resize(decode_image_file(images.paths[i])) for i in chunk]).to(device)
        logits = module.embed_images(normalize(batch)) @ classifier.T
        target = torch.tensor([images.labels[i] for i in chunk], device=device)
        for metric in metrics.values():
            metric.update(logits, target)
        if outcomes is not None:
            outcomes.update(logits, target, torch.tensor(chunk, device=device))
    scores = {k: metric.compute() for k, metric in metrics.items()}  # sums the counts over ranks
    module.train(was_training)
    return scores
