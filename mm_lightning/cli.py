"""Command line: ``python -m mm_lightning {fit,validate,test,predict} --config configs/<x>.yaml`` is a
``LightningCLI`` with the project's defaults and linked options: the tokenizer follows the text tower, image
preprocessing the image tower, logs and checkpoints the run directory. The other commands (``audit``, ``shard``,
``evaluate``, ``export``, ``zeroshot``) are modules with a ``main``, listed in ``--help``."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from importlib import import_module
from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, instantiate_class
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from typing_extensions import override

from mm_lightning import PUBLIC_PATHS
from mm_lightning.data import MultimodalDataModule
from mm_lightning.models import MultimodalModule
from mm_lightning.models.towers.contract import tokenizer_of
from mm_lightning.run_folder import check_resume, checkpoint_callbacks, folders_of
from mm_lightning.strategies import expand_strategy_name  # (also registers the "ddp_explicit" name)

# Commands with their own small parsers (mm_lightning.<name>.main), listed in ``--help`` with these lines.
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
    "plugins": [{"class_path": "mm_lightning.plugins.AtomicCheckpointIO"}],  # atomic saves; clear load errors
    "log_every_n_steps": 10,
}


def quiet_lightning_notices() -> None:
    """Silence Lightning notices a user of this CLI cannot act on (eval-mode towers, litlogger tip, etc.)."""
    warnings.filterwarnings(
        "ignore", message=r"Found \d+ module\(s\) in eval mode", category=PossibleUserWarning
    )
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    notices = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropNotices) for f in notices.filters):
        notices.addFilter(_DropNotices())


class _DropNotices(logging.Filter):
    UNACTIONABLE = ("litlogger", "Trainer already configured with model summary callbacks")

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in str(record.msg) for text in self.UNACTIONABLE)


def batch_size_of(batch: dict[str, Any]) -> int:
    """Number of image-text pairs in a batch (used by the throughput monitor)."""
    return int(batch["image"].shape[0])


BUILT_IN_PACKAGES = ("mm_lightning.callbacks", "mm_lightning.data", "mm_lightning.models.towers",
                     "mm_lightning.models.losses", "mm_lightning.strategies")  # fmt: skip


def expand_short_names(args: list[str]) -> list[str]:
    """Replace built-in short class names (``--model.image_tower TimmTower``) by their import paths.

    LightningCLI resolves short names only among loaded classes (config files must give the path)."""
    for package in BUILT_IN_PACKAGES:  # their exports fill PUBLIC_PATHS (nothing else loads yet)
        import_module(package)
    out = list(args)
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if eq and takes_a_class(key) and value in PUBLIC_PATHS:
            out[i] = f"{key}={PUBLIC_PATHS[value]}"
        elif i and takes_a_class(args[i - 1]) and arg in PUBLIC_PATHS:
            out[i] = PUBLIC_PATHS[arg]
    return out


CLASS_OPTIONS = {"model.image_tower", "model.text_tower", "model.loss", "trainer.strategy", "trainer.callbacks",
                 "trainer.plugins", "trainer.logger", "data"}  # fmt: skip


def takes_a_class(flag: str) -> bool:
    """Whether the option ``flag`` takes a class (a part, ``--data``, a callback, a ``class_path``)."""
    name = flag[2:].rstrip("+") if flag.startswith("--") else ""
    return name in CLASS_OPTIONS or name.endswith(".class_path")


def image_config_of(model: Any) -> dict[str, Any] | None:
    """The image tower's preprocessing (``model.data_config["image"]``), or None for a tower without one."""
    try:
        return model.data_config["image"]
    except (AttributeError, KeyError, NotImplementedError):
        return None


class PartsHelpFormatter(DefaultHelpFormatter):
    """``--help`` that names the built-in towers and losses instead of every loaded ``nn.Module`` subclass."""

    @override
    def _get_help_string(self, action: Any) -> str:
        text = super()._get_help_string(action)
        return re.sub(r"known subclasses: torch\.nn\.Module, [^)]*", BUILT_IN_PARTS, text, flags=re.S)


BUILT_IN_PARTS = "any nn.Module; built in: mm_lightning.models.{towers,losses}"


class CheckedParser(LightningArgumentParser):
    """The CLI's parser: errors that name the fix, a short ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", PartsHelpFormatter)
        super().__init__(*args, **kwargs)

    @override
    def print_usage(self, file: Any = None) -> None:
        (file or sys.stdout).write(f"usage: {self.short_usage()}\n")  # shown above a parser error

    @override
    def format_help(self) -> str:
        self.usage = self.short_usage()
        return super().format_help()

    def short_usage(self) -> str:
        # argparse's own usage would list every option once more
        return f"{self.prog.replace(' [options]', '')} [options]"

    @override
    def error(self, message: str, ex: Exception | None = None) -> Any:
        if "trainer.strategy" in message and "NestedArg" in message:
            message += (
                "\nA strategy registry name in a config file (e.g. strategy: ddp_explicit) takes no nested options;"
                " give the class instead (strategy: {class_path: mm_lightning.strategies.ExplicitAllReduceDDPStrategy,"
                " init_args: {mode: per_parameter}}, as configs/ddp_explicit.yaml does), or the name on the command line:"
                " --trainer.strategy ddp_explicit --trainer.strategy.mode per_parameter."
            )
        short_name = re.search(r"Expected a dot import path string: (\w+)\b", message)
        if short_name and short_name.group(1) in PUBLIC_PATHS:  # a built-in class loads when a run names it
            message += f"\nName the class by its path: {PUBLIC_PATHS[short_name.group(1)]}"
        return super().error(message, ex)


class MultimodalCLI(LightningCLI):
    """``LightningCLI`` with the project's defaults and linked args."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", CheckedParser)
        # --optimizer/--lr_scheduler would replace the module's per-tower param groups and schedule
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(*args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.text_tower", "data.init_args.tokenizer", compute_fn=tokenizer_of)
        parser.link_arguments("trainer.default_root_dir", "trainer.logger.init_args.save_dir")
        # the image tower's preprocessing reaches the data when both are built
        parser.link_arguments(
            "model", "data.init_args.image_config", compute_fn=image_config_of, apply_on="instantiate"
        )
        # a checkpoint's dirpath is defaulted in parse_arguments: a link cannot reach into the callbacks list

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is None or isinstance(args, list):
            given = sys.argv[1:] if args is None else args
            expanded = expand_short_names(expand_strategy_name(given))
            if expanded != given:
                args = expanded
        super().parse_arguments(parser, args)
        # the one method override besides add_arguments_to_parser (and __init__'s defaults): these read the
        # parsed config and must act before
        # LightningCLI reads a checkpoint's hyperparameters (right after parsing)
        self.default_checkpoint_dir()
        check_resume(self.config, parser)

    def default_checkpoint_dir(self) -> None:
        """Default a checkpoint callback's ``dirpath`` to last.ckpt's, or else to ``<run dir>/checkpoints``."""
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        saving = checkpoint_callbacks(config)
        for callback in saving:
            if callback.init_args.get("filename") == "last" and callback.init_args.get("monitor") is not None:
                self.parser.error(
                    "the ModelCheckpoint that writes last.ckpt has a monitor: last.ckpt would hold the best step,"
                    " not the latest; set the monitor on the other (best) checkpoint callback instead"
                )
        run_dir = config.get("trainer", {}).get("default_root_dir")
        folder = folders_of(saving)["last"] or (os.path.join(run_dir, "checkpoints") if run_dir else None)
        for callback in saving:
            if callback.init_args.get("dirpath") is None:
                callback.init_args.dirpath = folder


def instantiate_datamodule(spec: object) -> Any:
    """Build a datamodule from the parsed ``data`` section (``class_path`` / ``init_args``) of a config."""
    init = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)  # type: ignore[call-overload]
    return instantiate_class((), init)


def data_config_parser(command: str, options: type, nested_key: str | None = None) -> CheckedParser:
    """The parser of a command that reads a run's data only (``audit``, ``shard``): a config as ``fit`` takes it
    (``--config``, ``--data.*``, ``--model.*``, ``--trainer.*``), the text tower naming the data's tokenizer, and
    the dataclass ``options`` as more options (under ``nested_key``)."""
    from jsonargparse import ActionConfigFile
    from lightning.pytorch import LightningDataModule, Trainer

    parser = CheckedParser(prog=f"python -m mm_lightning {command}", description=STANDALONE_COMMANDS[command])
    parser.add_argument("--config", action=ActionConfigFile, help="a run's config (YAML), as fit takes it")
    parser.add_argument("--seed_everything", type=bool | int, default=True)
    parser.add_lightning_class_args(Trainer, "trainer")
    parser.add_lightning_class_args(MultimodalModule, "model")
    parser.add_lightning_class_args(LightningDataModule, "data", subclass_mode=True)
    parser.add_class_arguments(options, nested_key)
    parser.link_arguments("model.text_tower", "data.init_args.tokenizer", compute_fn=tokenizer_of)
    return parser


def read_data_config(
    argv: list[str] | None, command: str, options: type, nested_key: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """The data module of a run's config and the command's options, parsed by :func:`data_config_parser`. The
    model is checked, not built (its weights may be remote); the trainer section is not used."""
    parser = data_config_parser(command, options, nested_key)
    config = parser.parse_args(expand_short_names(list(argv or [])))
    given = config[nested_key] if nested_key else config
    return instantiate_datamodule(config.data), {f: given[f] for f in options.__dataclass_fields__}


def cli_main(
    args: list[str] | None = None, run: bool = True, cli_class: type = MultimodalCLI
) -> MultimodalCLI:
    """Build (and by default run) the CLI; ``args`` replaces ``sys.argv[1:]`` (tests, notebooks)."""
    quiet_lightning_notices()
    return cli_class(
        MultimodalModule,
        MultimodalDataModule,
        subclass_mode_data=True,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=42,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def other_commands() -> str:
    """The commands besides LightningCLI's, a line each, as ``python -m mm_lightning --help`` ends."""
    lines = [f"  {name:10s}{summary}" for name, summary in STANDALONE_COMMANDS.items()]
    return "\nother commands (python -m mm_lightning <command> --help):\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mm_lightning`` and ``mm-lightning``; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if args and args[0] in STANDALONE_COMMANDS:  # commands with their own small argument parsers
            return import_module(f"mm_lightning.{args[0]}").main(list(args[1:]))
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
