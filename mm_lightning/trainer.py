"""``MultimodalTrainer``: Lightning's ``Trainer`` plus the ``audit`` command the CLI exposes as a subcommand.

LightningCLI builds each subcommand's options from the trainer method of the same name, so ``audit`` lives here:
``python -m mm_lightning audit --config configs/demo.yaml --audit.max_error_rate 0.01``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.cli import instantiate_class
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


@dataclass
class AuditOptions:
    """Options of ``audit``.

    Args:
        output: Path of the JSON report.
        splits: Splits to scan (those without a file are skipped).
        workers: Image-decoding processes.
        max_error_rate: Exit with status 1 when (bad records / records) exceeds this.
        progress: Show a progress bar while decoding images.
    """

    output: str = "audit_report.json"
    splits: list[str] = field(default_factory=lambda: ["train", "val", "test"])
    workers: int = os.cpu_count() or 1
    max_error_rate: float = 0.0
    progress: bool = True


class MultimodalTrainer(Trainer):
    """``Trainer`` with :meth:`audit`; constructed with exactly ``Trainer``'s arguments.

    A ``None`` among the callbacks is left out: the CLI passes one for each callback group a config drops
    (``nan_guard: null``). Warns when a CPU run starts more processes than the machine has cores (each then gets
    a fraction of one).
    """

    def __init__(self, *args: Any, callbacks: list[Callback] | Callback | None = None, **kwargs: Any) -> None:
        if isinstance(callbacks, list):
            callbacks = [c for c in callbacks if c is not None]
        super().__init__(*args, callbacks=callbacks, **kwargs)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if isinstance(self.accelerator, CPUAccelerator) and self.num_devices > cores:  # processes per node
            rank_zero_warn(
                f"{self.num_devices} processes on {cores} CPU cores: they share the cores and every step waits for"
                f" the slowest; --trainer.devices {cores} or fewer runs faster."
            )

    def audit(
        self,
        model: LightningModule | None = None,
        datamodule: LightningDataModule | None = None,
        audit: AuditOptions | None = None,
    ) -> int:
        """Check every record, image and caption of the data before training and write a JSON report.

        Decodes every image in a process pool, tokenizes every caption and reports bad lines, missing or
        undecodable images, empty and overlong captions, duplicates and size histograms.

        Args:
            model: Unused (the audit reads the data only).
            datamodule: The data to check.
            audit: Report path, splits, workers and the error-rate threshold.

        Returns:
            0, or 1 when the error rate exceeds ``audit.max_error_rate`` or a split has no valid record.
        """
        from mm_lightning.data.audit import run_audit

        if audit is None:  # no --audit.* option given
            options = AuditOptions()
        elif isinstance(audit, AuditOptions):
            options = audit
        else:  # the parsed group (a Namespace or a dict)
            options = AuditOptions(**(audit if isinstance(audit, dict) else vars(audit)))
        if datamodule is None:
            raise ValueError("audit needs the data section of a config (--config ... or --data ...).")
        report = run_audit(
            datamodule,
            options.output,
            options.max_error_rate,
            options.splits,
            options.workers,
            options.progress,
        )
        if report["exit_code"]:
            rank_zero_info("audit: too many bad records or a split without a valid record: exit status 1")
        return report["exit_code"]

    def shard(
        self,
        model: LightningModule | None = None,
        datamodule: LightningDataModule | None = None,
        out: str = "shards",
        samples_per_shard: int = 10000,
        splits: list[str] | None = None,
        image_format: str = "copy",
        jpeg_quality: int = 95,
        validate: bool = True,
        workers: int | None = None,
        progress: bool = True,
    ) -> int:
        """Convert the data's JSONL splits into WebDataset shards (img2dataset's layout) under ``out/<split>/``.

        Args:
            model: Unused (only the data is read).
            datamodule: The data to convert.
            out: Output folder.
            samples_per_shard: Records per shard (the last one of a split may be smaller).
            splits: Splits to convert (default: train, val, test; those without a file are skipped).
            image_format: ``copy`` keeps each image's bytes; ``jpg`` re-encodes as JPEG.
            jpeg_quality: JPEG quality when re-encoding.
            validate: Decode every image while writing (bad ones never reach a shard).
            workers: Writer processes (default: every CPU).
            progress: Show a progress bar.

        Returns:
            0 (a bad record under ``on_bad_record=raise`` raises, naming file, line and reason).
        """
        from mm_lightning.data.shard_writer import ShardOptions, shard_datamodule

        if datamodule is None:
            raise ValueError("shard needs the data section of a config (--config ... or --data ...).")
        options = ShardOptions(
            out, samples_per_shard, splits or ["train", "val", "test"], image_format,  # type: ignore[arg-type]
            jpeg_quality, validate, workers, progress,
        )  # fmt: skip
        shard_datamodule(datamodule, options)
        return 0


def instantiate_datamodule(spec: object) -> LightningDataModule:
    """Build a datamodule from its parsed ``class_path`` / ``init_args`` spec (a jsonargparse Namespace).

    Args:
        spec: The ``data`` section of a parsed config.
    """
    init = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)  # type: ignore[call-overload]
    return instantiate_class((), init)
