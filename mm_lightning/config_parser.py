"""Parsing a run's config (``fit``'s and the data commands'): a parser whose errors name the fix and whose
``--help`` is short, every run's default callbacks, and the data of a config read alone (``audit``, ``shard``)."""

from __future__ import annotations

import re
import sys
from importlib import import_module
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, instantiate_class
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from mm_lightning.models import MultimodalModule
from mm_lightning.models.towers.contract import TowerContractError

BUILT_IN_PACKAGES = ("mm_lightning.callbacks", "mm_lightning.data", "mm_lightning.models.towers",
                     "mm_lightning.models.losses", "mm_lightning.extras")  # fmt: skip
DEFAULT_CALLBACKS = Path(__file__).parent / "callbacks" / "default.yaml"
DEFAULT_CHECKPOINTS = Path(__file__).parent / "callbacks" / "checkpoints.yaml"
# the run's ModelCheckpoints as option groups (--checkpoint.every_n_train_steps 500), in the order they run
CHECKPOINT_GROUPS = ("best_checkpoint", "checkpoint", "timed_checkpoint")


def tokenizer_of(text_tower: Any) -> str | None:
    """The tokenizer of a text tower given by ``class_path`` + ``init_args`` (for the CLI's link).

    A built-in tower says it (``tokenizer_for``), a user's tower by its ``tokenizer`` argument.
    """
    if text_tower is None:
        return None
    spec = text_tower.as_dict() if isinstance(text_tower, Namespace) else dict(text_tower)
    class_path, init_args = spec.get("class_path"), dict(spec.get("init_args") or {})
    if not isinstance(class_path, str):
        return None  # not a class (yet): nothing to link
    module, _, name = class_path.rpartition(".")
    tower_class = getattr(import_module(module), name)
    if hasattr(tower_class, "tokenizer_for"):
        return tower_class.tokenizer_for(init_args)
    if init_args.get("tokenizer") is not None:
        return str(init_args["tokenizer"])
    raise TowerContractError(
        f"text tower {class_path} names no tokenizer: give it a `tokenizer` argument (the tokenizer its input ids"
        " come from, e.g. tokenizer: mm-lightning/demo-bert)"
    )


def add_default_callbacks(parser: LightningArgumentParser) -> None:
    """Every run's callbacks: the checkpoint groups (``callbacks/checkpoints.yaml``) and ``trainer.callbacks``'
    default list (``callbacks/default.yaml``), which a recipe extends with ``callbacks+``."""
    for key in CHECKPOINT_GROUPS:
        parser.add_lightning_class_args(ModelCheckpoint, key)
    parser.set_defaults(yaml.safe_load(DEFAULT_CHECKPOINTS.read_text()))
    parser.set_defaults({"trainer.callbacks": yaml.safe_load(DEFAULT_CALLBACKS.read_text())})


def explicit_all_reduce(**init_params: Any) -> Any:
    """The registry's constructor for ``ddp_explicit``: imports the strategy (an extra) when a run names it."""
    from mm_lightning.extras import ExplicitAllReduceDDPStrategy

    return ExplicitAllReduceDDPStrategy(**init_params)


for _name, _start_method in (("ddp_explicit", "popen"), ("ddp_explicit_spawn", "spawn")):
    StrategyRegistry.register(
        _name,
        explicit_all_reduce,
        description=f"DDP with an explicit gradient all-reduce, start_method '{_start_method}'",
        override=True,
        start_method=_start_method,
    )


# what --help says of a part's option instead of listing every loaded nn.Module subclass
ANY_MODULE = re.compile(r"known\s+subclasses:\s+torch\.nn\.Module,[^)]*")  # across wrapped lines
BUILT_IN_PARTS = "any nn.Module; built in: mm_lightning.models.{towers,losses}"


def public_path(name: str) -> str:
    """The import path of a built-in class by its short name (``name`` itself if none is built in)."""
    for package in BUILT_IN_PACKAGES:
        if name in getattr(import_module(package), "__all__", ()):
            return f"{package}.{name}"
    return name


class CheckedParser(LightningArgumentParser):
    """The CLI's parser: errors that name the fix, a short ``--help``."""

    @override
    def print_usage(self, file: Any = None) -> None:
        (file or sys.stdout).write(f"usage: {self.short_usage()}\n")  # shown above a parser error

    @override
    def format_help(self) -> str:
        self.usage = self.short_usage()
        return ANY_MODULE.sub(BUILT_IN_PARTS, super().format_help())

    def short_usage(self) -> str:
        # argparse's own usage would list every option once more
        return f"{self.prog.replace(' [options]', '')} [options]"

    @override
    def error(self, message: str, ex: Exception | None = None) -> Any:
        if "trainer.strategy" in message and "NestedArg" in message:
            message += (
                "\nA strategy registry name (e.g. ddp_explicit) takes no nested options; give the class instead, in a"
                " config (strategy: {class_path: mm_lightning.extras.ExplicitAllReduceDDPStrategy, init_args: {mode:"
                " per_parameter}}, as configs/ddp_explicit.yaml does) or on the command line (--trainer.strategy"
                " mm_lightning.extras.ExplicitAllReduceDDPStrategy --trainer.strategy.mode per_parameter)."
            )
        short_name = re.search(r"Expected a dot import path string: (\w+)\b", message)
        if short_name and public_path(short_name.group(1)) != short_name.group(1):  # a built-in class
            message += f"\nName the class by its path: {public_path(short_name.group(1))}"
        return super().error(message, ex)


def instantiate_datamodule(spec: object) -> Any:
    """Build a datamodule from the parsed ``data`` section (``class_path`` / ``init_args``) of a config."""
    init = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)  # type: ignore[call-overload]
    return instantiate_class((), init)


def data_config_parser(
    command: str, options: type, nested_key: str | None = None, description: str | None = None
) -> CheckedParser:
    """The parser of a command that reads a run's data only (``audit``, ``shard``): a config as ``fit`` takes it
    (``--config``, ``--data.*``, ``--model.*``, ``--trainer.*``), the text tower naming the data's tokenizer, and
    the dataclass ``options`` as more options (under ``nested_key``)."""
    from jsonargparse import ActionConfigFile
    from lightning.pytorch import LightningDataModule, Trainer

    parser = CheckedParser(prog=f"python -m mm_lightning {command}", description=description)
    parser.add_argument("--config", action=ActionConfigFile, help="a run's config (YAML), as fit takes it")
    parser.add_argument("--seed_everything", type=bool | int, default=True)
    parser.add_lightning_class_args(Trainer, "trainer")
    parser.add_lightning_class_args(MultimodalModule, "model")
    parser.add_lightning_class_args(LightningDataModule, "data", subclass_mode=True)
    add_default_callbacks(parser)  # a run's config may set them
    parser.add_class_arguments(options, nested_key)
    parser.link_arguments("model.text_tower", "data.init_args.tokenizer", compute_fn=tokenizer_of)
    return parser


def read_data_config(
    argv: list[str] | None,
    command: str,
    options: type,
    nested_key: str | None = None,
    description: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The data module of a run's config and the command's options, parsed by :func:`data_config_parser`. The
    model is checked, not built (its weights may be remote); the trainer section is not used."""
    parser = data_config_parser(command, options, nested_key, description)
    config = parser.parse_args(list(argv or []))
    given = config[nested_key] if nested_key else config
    return instantiate_datamodule(config.data), {f: given[f] for f in options.__dataclass_fields__}
