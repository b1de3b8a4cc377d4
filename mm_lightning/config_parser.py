"""Parsing a run's config (``fit``'s and the data commands'): a parser whose errors name the fix and whose
``--help`` is short, built-in classes by their short names on the command line, and the data of a config read
alone (``audit``, ``shard``)."""

from __future__ import annotations

import json
import re
import sys
from importlib import import_module
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, instantiate_class
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from mm_lightning import PUBLIC_PATHS
from mm_lightning.models import MultimodalModule
from mm_lightning.models.towers.contract import tokenizer_of

BUILT_IN_PACKAGES = ("mm_lightning.callbacks", "mm_lightning.data", "mm_lightning.models.towers",
                     "mm_lightning.models.losses", "mm_lightning.extras")  # fmt: skip
EXPLICIT_ALL_REDUCE = "mm_lightning.extras.ExplicitAllReduceDDPStrategy"
DEFAULT_CALLBACKS = Path(__file__).parent / "callbacks" / "default.yaml"
DEFAULT_CHECKPOINTS = Path(__file__).parent / "callbacks" / "checkpoints.yaml"
# the run's ModelCheckpoints as option groups (--checkpoint.every_n_train_steps 500), in the order they run
CHECKPOINT_GROUPS = ("best_checkpoint", "checkpoint", "timed_checkpoint")


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


explicit_all_reduce.class_path = EXPLICIT_ALL_REDUCE  # type: ignore[attr-defined]  (what the CLI expands the name to)

for _name, _start_method in (("ddp_explicit", "popen"), ("ddp_explicit_spawn", "spawn")):
    StrategyRegistry.register(
        _name,
        explicit_all_reduce,
        description=f"DDP with an explicit gradient all-reduce, start_method '{_start_method}'",
        override=True,
        start_method=_start_method,
    )


def expand_strategy_name(args: list[str]) -> list[str]:
    """With ``--trainer.strategy.<option>`` given, turn ``--trainer.strategy <registry name>`` into its class
    (plus the registry entry's options): jsonargparse takes nested options only under a class."""
    if not any(a.startswith("--trainer.strategy.") for a in args):
        return args
    out: list[str] = []
    i = 0
    while i < len(args):
        arg, name = args[i], None
        if arg == "--trainer.strategy" and i + 1 < len(args):
            name, i = args[i + 1], i + 2
        elif arg.startswith("--trainer.strategy="):
            name, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        if name not in StrategyRegistry:
            out += ["--trainer.strategy", name]
            continue
        entry = StrategyRegistry[name]
        build = entry["strategy"]  # a class, or a constructor naming its class
        class_path = getattr(build, "class_path", f"{build.__module__}.{build.__qualname__}")
        out += ["--trainer.strategy", class_path]
        for key, value in entry["init_params"].items():
            out += [f"--trainer.strategy.{key}", value if isinstance(value, str) else json.dumps(value)]
    return out


def expand_short_names(args: list[str]) -> list[str]:
    """Replace built-in short class names (``--model.image_tower TimmTower``) by their import paths.

    LightningCLI resolves short names only among loaded classes (config files must give the path)."""
    out = list(args)
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if eq and takes_a_class(key) and value.isidentifier():
            out[i] = f"{key}={public_path(value)}"
        elif i and takes_a_class(args[i - 1]) and arg.isidentifier():
            out[i] = public_path(arg)
    return out


def public_path(name: str) -> str:
    """The import path of a built-in class by its short name (``name`` itself if none is built in)."""
    # their exports fill PUBLIC_PATHS; loaded only when a short name is given
    for package in BUILT_IN_PACKAGES:
        import_module(package)
    return PUBLIC_PATHS.get(name, name)


CLASS_OPTIONS = {"model.image_tower", "model.text_tower", "model.loss", "trainer.strategy", "trainer.callbacks",
                 "trainer.plugins", "trainer.logger", "data"}  # fmt: skip


def takes_a_class(flag: str) -> bool:
    """Whether the option ``flag`` takes a class (a part, ``--data``, a callback, a ``class_path``)."""
    name = flag[2:].rstrip("+") if flag.startswith("--") else ""
    return name in CLASS_OPTIONS or name.endswith(".class_path")


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
                " give the class instead (strategy: {class_path: mm_lightning.extras.ExplicitAllReduceDDPStrategy,"
                " init_args: {mode: per_parameter}}, as configs/ddp_explicit.yaml does), or the name on the command line:"
                " --trainer.strategy ddp_explicit --trainer.strategy.mode per_parameter."
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
    config = parser.parse_args(expand_short_names(list(argv or [])))
    given = config[nested_key] if nested_key else config
    return instantiate_datamodule(config.data), {f: given[f] for f in options.__dataclass_fields__}
