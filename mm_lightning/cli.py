"""Command line: ``python -m mm_lightning {fit,validate,test,predict,audit} --config configs/<x>.yaml``.

A ``LightningCLI`` over :class:`~mm_lightning.models.MultimodalModule` and any
:class:`~mm_lightning.data.MultimodalDataModule` subclass, with the defaults a run needs (TensorBoard, last +
best checkpoints written atomically, learning-rate and throughput monitors, a seed) and the arguments that must
agree linked, so a user changes one line:

* ``model.text_encoder`` -> ``data.tokenizer`` (the tokenizer always matches the text encoder);
* ``data.image_size`` -> ``model.image_size`` (size-dependent image encoders such as ViT are built to match);
* ``trainer.default_root_dir`` (the run directory) -> the logger's ``save_dir`` and ``checkpoint.dirpath``
  (``<run dir>/checkpoints``): one option moves a run's logs, config and checkpoints together.

Examples::

    python -m mm_lightning fit --config configs/demo.yaml
    python -m mm_lightning fit --config configs/demo.yaml --trainer.default_root_dir runs/try2
    python -m mm_lightning fit --config configs/base.yaml --config configs/ddp_explicit.yaml --data.batch_size 64
    python -m mm_lightning fit --config configs/demo.yaml --print_config
    python -m mm_lightning audit --config configs/demo.yaml
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

import mm_lightning.strategies  # noqa: F401  (registers the "ddp_explicit" strategy name)
from mm_lightning.callbacks import (
    EmbeddingWriter,
    ExactResume,
    GradNormMonitor,
    NaNGuard,
    PeakMemoryMonitor,
    PreemptionCheckpoint,
    ResilientCheckpoint,
    RetrievalGridLogger,
    StepTimeMonitor,
)
from mm_lightning.data import BadRecordLogger, MultimodalDataModule
from mm_lightning.models import MultimodalModule
from mm_lightning.resume import ResumeOverrides
from mm_lightning.trainer import MultimodalTrainer, instantiate_datamodule

TRAINER_DEFAULTS: dict[str, Any] = {
    # The run directory: TensorBoard events (one version_N folder per fit), config.yaml, checkpoints/.
    "default_root_dir": "logs/mm_lightning",
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "logs/mm_lightning", "name": "", "default_hp_metric": False},
    },
    # Atomic, durable checkpoint saves and loads that explain a bad file (mm_lightning.plugins).
    "plugins": [{"class_path": "mm_lightning.plugins.AtomicCheckpointIO"}],
    "log_every_n_steps": 10,
}

# Callback groups: always present and configurable from the command line (--checkpoint.every_n_train_steps 500,
# --nan_guard.max_consecutive 5), unlike trainer.callbacks, which a config's list replaces.
CALLBACK_GROUPS: dict[str, type] = {
    # last.ckpt every N steps and at epoch end, "best" by the monitored metric after each validation
    "checkpoint": ResilientCheckpoint,
    "lr_monitor": LearningRateMonitor,
    # samples/s and batches/s over a sliding window of steps
    "throughput": ThroughputMonitor,
    # data/skipped (cumulative, all ranks) + the first reasons, when on_bad_record=skip replaces samples
    "bad_records": BadRecordLogger,
    # acts only in `predict`: one embeddings file per rank (README "Predict: export embeddings")
    "prediction": EmbeddingWriter,
    # skip non-finite steps, stop after K in a row
    "nan_guard": NaNGuard,
    # SIGTERM / SIGUSR1 -> save last.ckpt after this batch, exit 0
    "preemption": PreemptionCheckpoint,
    # RNG states and loader position, so a resumed run continues bit for bit
    "exact_resume": ExactResume,
    # the README's monitors (TensorBoard section)
    "step_time": StepTimeMonitor,
    "peak_memory": PeakMemoryMonitor,
    "grad_norm": GradNormMonitor,
    "retrieval_grid": RetrievalGridLogger,
}


def batch_size_of(batch: dict[str, Any]) -> int:
    """Number of image-text pairs in a batch (used by the throughput monitor)."""
    return int(batch["image"].shape[0])


def checkpoint_dir_of(run_dir: str) -> str:
    """Where a run directory keeps its checkpoints."""
    return os.path.join(run_dir, "checkpoints")


class CheckedParser(LightningArgumentParser):
    """The CLI's parser; adds the fix to jsonargparse's error for options nested under a strategy *name*."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> Any:
        if "trainer.strategy" in message and "NestedArg" in message:
            message += (
                "\nA strategy registry name (e.g. ddp_explicit) takes no nested options; give the class instead:"
                " --trainer.strategy ExplicitAllReduceDDPStrategy --trainer.strategy.mode per_parameter"
                " (or use configs/ddp_explicit.yaml)."
            )
        return super().error(message, ex)


class MultimodalCLI(LightningCLI):
    """LightningCLI with the project's defaults, callback groups, linked arguments and the ``audit`` command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_class", MultimodalTrainer)
        kwargs.setdefault("parser_class", CheckedParser)
        self.resume_overrides = ResumeOverrides()
        self.exit_code = 0
        super().__init__(*args, **kwargs)

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {**LightningCLI.subcommands(), "audit": {"model", "datamodule"}}

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for group, callback_class in CALLBACK_GROUPS.items():
            parser.add_lightning_class_args(callback_class, group)
        parser.set_defaults(
            {
                "checkpoint.filename": "best-{epoch}-{step}",
                "checkpoint.monitor": "val/r1_t2i",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.auto_insert_metric_name": False,
                "lr_monitor.logging_interval": "step",
                # Lightning's default window is 100 steps
                "throughput.batch_size_fn": batch_size_of,
                "throughput.window_size": 20,
            }
        )
        parser.link_arguments("model.text_encoder", "data.init_args.tokenizer")
        parser.link_arguments("data.init_args.image_size", "model.image_size")
        parser.link_arguments("trainer.default_root_dir", "trainer.logger.init_args.save_dir")
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir_of)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # Before LightningCLI reads the checkpoint's hyperparameters (it loads the file right after parsing).
        self.resume_overrides.before_checkpoint_hparams(self, parser)

    @override
    def before_instantiate_classes(self) -> None:
        self.resume_overrides.warn_if_overridden(self)

    @override
    def instantiate_classes(self) -> None:
        if self.subcommand != "audit":
            super().instantiate_classes()
            return
        # The audit reads the data only: no model (its weights may be remote), no accelerator, no logger.
        self.config_init = self.config
        self.datamodule = instantiate_datamodule(self.config.audit.data)
        self.model = None
        self.trainer = MultimodalTrainer(
            accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
        )

    def audit(self, model: Any, datamodule: Any, **options: Any) -> None:
        """Runs :meth:`MultimodalTrainer.audit` and keeps its exit status for :func:`main`."""
        # the parsed ``--audit.*`` group (LightningCLI passes a dataclass argument's fields individually)
        self.exit_code = self.trainer.audit(model, datamodule, self.config.audit.audit)


def cli_main(args: list[str] | None = None, run: bool = True) -> MultimodalCLI:
    """Build (and by default run) the CLI; ``args`` replaces ``sys.argv[1:]`` (used by tests and notebooks)."""
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
    """Entry point of ``python -m mm_lightning`` and the ``mm-lightning`` script; returns the exit code."""
    return cli_main(argv).exit_code
