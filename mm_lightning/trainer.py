"""``MultimodalTrainer``: Lightning's ``Trainer`` plus the ``audit`` command the CLI exposes as a subcommand.

LightningCLI builds each subcommand's options from the trainer method of the same name, so ``audit`` lives here:
``python -m mm_lightning audit --config configs/demo.yaml --audit.max_error_rate 0.01``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import instantiate_class
from lightning.pytorch.utilities.rank_zero import rank_zero_info


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
    """``Trainer`` with :meth:`audit`; constructed with exactly ``Trainer``'s arguments."""

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
            0, or 1 when the error rate exceeds ``audit.max_error_rate``.
        """
        from mm_lightning.data.audit import audit as run_audit

        options = audit if isinstance(audit, AuditOptions) else AuditOptions(**dict(vars(audit or {})))
        if datamodule is None:
            raise ValueError("audit needs the data section of a config (--config ... or --data ...).")
        datamodule.prepare_data()
        report = run_audit(datamodule, options.splits, options.workers, options.progress)
        report["max_error_rate"] = options.max_error_rate
        os.makedirs(os.path.dirname(os.path.abspath(options.output)), exist_ok=True)
        with open(options.output, "w") as f:
            json.dump(report, f, indent=2)
        print(
            f"audit: {report['records']} records, {report['errors']} errors "
            f"(rate {report['error_rate']:.4f}, max {options.max_error_rate}); report: {options.output}"
        )
        for split, rep in report["splits"].items():
            print(
                f"  {split}: {rep['records']} records, {rep['images']} images, bad {rep['bad_lines'] or 'none'},"
                f" overlong captions {rep['overlong_captions']}, duplicate captions {rep['duplicate_captions']}"
            )
        failed = report["error_rate"] > options.max_error_rate
        if failed:
            rank_zero_info(f"audit: error rate above {options.max_error_rate}: exit status 1")
        return 1 if failed else 0


def instantiate_datamodule(spec: object) -> LightningDataModule:
    """Build a datamodule from its parsed ``class_path`` / ``init_args`` spec (a jsonargparse Namespace).

    Args:
        spec: The ``data`` section of a parsed config.
    """
    init = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)  # type: ignore[call-overload]
    return instantiate_class((), init)
