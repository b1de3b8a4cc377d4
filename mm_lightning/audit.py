"""``python -m mm_lightning audit --config <run config>``: check every record, image and caption of the config's data
before training (the same checks as ``fit``), write a JSON report; exit status 1 above the error-rate threshold."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class AuditOptions:
    """Options of ``audit``.

    Args:
        output: Path of the JSON report.
        splits: Splits to scan (those without a file are skipped).
        workers: Image-decoding processes.
        max_error_rate: Exit with status 1 when (bad records / records) exceeds this.
        progress: Show a progress bar while decoding images."""

    output: str = "audit_report.json"
    splits: list[str] = field(default_factory=lambda: ["train", "val", "test"])
    workers: int = os.cpu_count() or 1
    max_error_rate: float = 0.0
    progress: bool = True


def main(argv: list[str] | None = None) -> int:
    """Audit the data of a run's config (``--config``, ``--data.*``; ``--audit.*`` for the options above)."""
    from mm_lightning.cli import STANDALONE_COMMANDS
    from mm_lightning.config_parser import read_data_config
    from mm_lightning.data.audit import run_audit

    datamodule, given = read_data_config(
        argv, "audit", AuditOptions, "audit", description=STANDALONE_COMMANDS["audit"]
    )
    options = AuditOptions(**given)
    report = run_audit(
        datamodule, options.output, options.max_error_rate, options.splits, options.workers, options.progress
    )
    if report["exit_code"]:
        print("audit: too many bad records or a split without a valid record: exit status 1", flush=True)
    return report["exit_code"]
