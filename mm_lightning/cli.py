"""Command line: ``python -m mm_lightning {fit,validate,test,predict,audit} --config configs/<x>.yaml``.

A ``LightningCLI`` over :class:`~mm_lightning.models.MultimodalModule` and any
:class:`~mm_lightning.data.MultimodalDataModule` subclass, with the defaults a run needs (TensorBoard under
``logs/``, last + best checkpoints, learning-rate and throughput monitors, a seed) and the arguments that must
agree linked, so a user changes one line:

* ``model.text.name`` -> ``data.tokenizer`` (the tokenizer always matches the text tower);
* ``data.image_size`` -> ``model.image.image_size`` (size-dependent image towers such as ViT are built to match).

Examples::

    python -m mm_lightning fit --config configs/demo.yaml
    python -m mm_lightning fit --config configs/base.yaml --config configs/ddp_explicit.yaml --data.batch_size 64
    python -m mm_lightning fit --config configs/demo.yaml --print_config
    python -m mm_lightning audit --config configs/demo.yaml
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

import mm_lightning.strategies  # noqa: F401  (registers the "ddp_explicit" strategy name)
from mm_lightning.callbacks import EmbeddingWriter
from mm_lightning.checkpointing import ResilientCheckpoint
from mm_lightning.data import BadRecordLogger, MultimodalDataModule
from mm_lightning.models import MultimodalModule

EXPLICIT_STRATEGY = "mm_lightning.strategies.ExplicitAllReduceDDPStrategy"
TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "logs", "name": "mm_lightning", "default_hp_metric": False},
    },
    "log_every_n_steps": 10,
    # >>> resilience defaults
    # <<< resilience defaults
}


def batch_size_of(batch: dict[str, Any]) -> int:
    """Number of image-text pairs in a batch (used by the throughput monitor)."""
    return int(batch["image"].shape[0])


class MultimodalCLI(LightningCLI):
    """LightningCLI with the project's defaults, callback groups and linked arguments."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Callbacks added as argument groups are always present and configurable from the command line
        # (--checkpoint.every_n_train_steps 500), unlike trainer.callbacks which a config list replaces.
        # ModelCheckpoint's arguments; last.ckpt every N steps and at epoch end, atomic writes, fresh "best".
        parser.add_lightning_class_args(ResilientCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.dirpath": "logs/mm_lightning/checkpoints",
                "checkpoint.filename": "best-{epoch}-{step}",
                "checkpoint.monitor": "val/r1_t2i",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.auto_insert_metric_name": False,
            }
        )
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_lightning_class_args(ThroughputMonitor, "throughput")
        # samples/s and batches/s over a sliding window of steps (Lightning's default window is 100 steps)
        parser.set_defaults({"throughput.batch_size_fn": batch_size_of, "throughput.window_size": 20})
        # data/skipped (cumulative, all ranks) + the first reasons, when on_bad_record=skip replaces samples
        parser.add_lightning_class_args(BadRecordLogger, "bad_records")
        # Acts only in `predict`: one embeddings file per rank (see README "Predict: export embeddings").
        parser.add_lightning_class_args(EmbeddingWriter, "prediction")
        # >>> resilience defaults (argument groups)
        from mm_lightning.callbacks import (
            GradNormMonitor,
            NaNGuard,
            PeakMemoryMonitor,
            RetrievalGridLogger,
            StepTimeMonitor,
        )
        from mm_lightning.checkpointing import ExactResume, PreemptionCheckpoint

        # Always-on groups (configurable, e.g. --nan_guard.max_consecutive 5): NaN/Inf guard, SIGTERM/SIGUSR1 ->
        # save last.ckpt + exit 0, exact resume (RNG states, loader position) and the README's monitors.
        resilience_groups = {
            "nan_guard": NaNGuard,
            "preemption": PreemptionCheckpoint,
            "exact_resume": ExactResume,
            "step_time": StepTimeMonitor,
            "peak_memory": PeakMemoryMonitor,
            "grad_norm": GradNormMonitor,
            "retrieval_grid": RetrievalGridLogger,
        }
        for group, callback_class in resilience_groups.items():
            parser.add_lightning_class_args(callback_class, group)
        # <<< resilience defaults (argument groups)
        parser.link_arguments("model.text.name", "data.init_args.tokenizer")
        parser.link_arguments("data.init_args.image_size", "model.image.image_size")


def expand_strategy_name(args: list[str]) -> list[str]:
    """Let ``--trainer.strategy ddp_explicit`` take nested options such as ``--trainer.strategy.mode``.

    jsonargparse accepts a registry name only as a plain string, so nested options need the class path.
    """
    if not any(a.startswith("--trainer.strategy.") for a in args):
        return args
    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--trainer.strategy=ddp_explicit":
            out[i] = f"--trainer.strategy={EXPLICIT_STRATEGY}"
        elif arg == "--trainer.strategy" and i + 1 < len(out) and out[i + 1] == "ddp_explicit":
            out[i + 1] = EXPLICIT_STRATEGY
    return out


def cli_main(args: list[str] | None = None, run: bool = True) -> MultimodalCLI:
    """Build (and by default run) the CLI; ``args`` replaces ``sys.argv[1:]`` (used by tests and notebooks)."""
    if args is not None:
        args = expand_strategy_name(args)
    return MultimodalCLI(
        MultimodalModule,
        MultimodalDataModule,
        subclass_mode_data=True,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=42,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mm_lightning`` and the ``mm-lightning`` script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "audit":
        from mm_lightning.data.audit import main as audit_main

        return audit_main(args[1:])
    if argv is None:
        sys.argv[1:] = expand_strategy_name(sys.argv[1:])  # LightningCLI reads sys.argv itself
    cli_main(argv)
    return 0
