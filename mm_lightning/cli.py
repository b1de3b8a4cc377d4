"""Command line: ``python -m mm_lightning {fit,validate,test,predict} --config configs/<x>.yaml`` is a
``LightningCLI`` with the project's defaults and linked options: the tokenizer follows the text tower, image
preprocessing the image tower, logs and checkpoints the run directory. The other commands (``audit``, ``shard``,
``evaluate``, ``export``, ``zeroshot``) are modules with a ``main``, listed in ``--help``."""

from __future__ import annotations

import logging
import sys
import warnings
from importlib import import_module
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from mm_lightning.checkpoints.run_folder import check_run_folder, check_sharded_resume
from mm_lightning.config_parser import CHECKPOINT_GROUPS, CheckedParser, add_default_callbacks, tokenizer_of
from mm_lightning.data import MultimodalDataModule
from mm_lightning.models import MultimodalModule

# Commands with their own small parsers (mm_lightning.commands.<name>.main), listed in ``--help`` with these lines.
STANDALONE_COMMANDS = {
    "audit": "Check every record, image and caption of a config's data; JSON report (options: audit --help).",
    "shard": "Convert a config's JSONL splits and images into WebDataset shards (options: shard --help).",
    "evaluate": "Score a checkpoint under CLIP_benchmark's protocol: JSON + table (options: evaluate --help).",
    "export": "Export a checkpoint as a Hugging Face model directory (options: export --help).",
    "zeroshot": "Zero-shot classification of labeled images with a checkpoint (options: zeroshot --help).",
}
TRAINER_DEFAULTS: dict[str, Any] = {
    "default_root_dir": "logs/mm_lightning",  # the run dir: TensorBoard events, config.yaml, checkpoints/
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "logs/mm_lightning", "name": "", "default_hp_metric": False},
    },
    # atomic saves; clear load errors
    "plugins": [{"class_path": "mm_lightning.checkpoints.AtomicCheckpointIO"}],
    "log_every_n_steps": 10,
}


def quiet_lightning_notices() -> None:
    """Silence Lightning notices a user of this CLI cannot act on (eval-mode towers, litlogger tip, etc.)."""
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    notices = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropNotices) for f in notices.filters):
        notices.addFilter(_DropNotices())


class _DropNotices(logging.Filter):
    UNACTIONABLE = ("litlogger", "Trainer already configured with model summary callbacks")

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in str(record.msg) for text in self.UNACTIONABLE)


def image_config_of(model: Any) -> dict[str, Any] | None:
    """The image tower's preprocessing (``model.data_config["image"]``), or None for a tower without one."""
    try:
        return model.data_config["image"]
    except (AttributeError, KeyError, NotImplementedError):
        return None


class MultimodalCLI(LightningCLI):
    """``LightningCLI`` with the project's linked options and checks of the run folder; build it with
    :func:`cli_main`, which passes the project's defaults."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # the checkpoint groups and the default callbacks; a recipe adds its own after them (callbacks+)
        add_default_callbacks(parser)
        parser.link_arguments("model.text_tower", "data.init_args.tokenizer", compute_fn=tokenizer_of)
        parser.link_arguments("trainer.default_root_dir", "trainer.logger.init_args.save_dir")
        # the image tower's preprocessing reaches the data when both are built
        parser.link_arguments(
            "model", "data.init_args.image_config", compute_fn=image_config_of, apply_on="instantiate"
        )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # The one more override: the run-folder checks read the parsed config and must act before LightningCLI
        # reads a checkpoint's hyperparameters (right after parsing); a link cannot reach into trainer.callbacks.
        given = sys.argv[1:] if args is None else args
        with warnings.catch_warnings():
            # given arguments replace the process's own (cli_main's contract), so LightningCLI's warning is moot
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            super().parse_arguments(parser, args)
        self.run_data_options = check_run_folder(
            self.config, parser, given if isinstance(given, list) else (), CHECKPOINT_GROUPS
        )

    @override
    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        if self.subcommand == "fit":
            check_sharded_resume(self.config["fit"].get("ckpt_path"), self.trainer.strategy)
        if self.trainer.world_size > 1:  # every process builds its trainer here; see gloo_exit_abort.py
            import_module("mm_lightning.gloo_exit_abort").install()


def cli_main(
    args: list[str] | None = None, run: bool = True, cli_class: type = MultimodalCLI, **cli_options: Any
) -> MultimodalCLI:
    """Build (and by default run) the CLI; ``args`` replaces ``sys.argv[1:]`` (tests, notebooks), ``cli_options``
    replace LightningCLI options of the project's defaults."""
    quiet_lightning_notices()
    options: dict[str, Any] = {
        "subclass_mode_data": True,
        "trainer_defaults": TRAINER_DEFAULTS,
        "seed_everything_default": 42,
        "save_config_kwargs": {"overwrite": True},
        "parser_class": CheckedParser,
        # --optimizer/--lr_scheduler would replace the module's per-tower param groups and schedule
        "auto_configure_optimizers": False,
    }
    return cli_class(MultimodalModule, MultimodalDataModule, args=args, run=run, **{**options, **cli_options})


def other_commands() -> str:
    """The commands besides LightningCLI's, a line each, as ``python -m mm_lightning --help`` ends."""
    lines = [f"  {name:10s}{summary}" for name, summary in STANDALONE_COMMANDS.items()]
    return "\nother commands (python -m mm_lightning <command> --help):\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mm_lightning`` and ``mm-lightning``; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if args and args[0] in STANDALONE_COMMANDS:  # commands with their own small argument parsers
            return import_module(f"mm_lightning.commands.{args[0]}").main(list(args[1:]))
        try:
            cli_main(argv)
        finally:
            if not args or args[0] in ("-h", "--help"):  # after LightningCLI's own commands
                print(other_commands(), flush=True)
        return 0
    except Exception as err:
        from mm_lightning.errors import cli_message, show_traceback

        # the project's errors: the reason and the fix, not a traceback
        message = None if show_traceback() else cli_message(err)
        if message is None:
            raise
        print(message, file=sys.stderr, flush=True)
        return 1
