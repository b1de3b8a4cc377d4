"""The run folder, checked right after parsing (:func:`check_run_folder`): where the checkpoint callbacks write,
a fresh ``fit`` refused over an earlier run, and ``--ckpt_path`` checked before loading (``last``, the file,
the options it replaces)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from mm_lightning import ExplainedError
from mm_lightning.checkpoints.files import CheckpointFileError, nothing_left_to_train, run_checkpoint


def listed_checkpoints(config: Any) -> list[Any]:
    """The init arguments of the ``ModelCheckpoint`` entries (and subclasses) of a parsed config's
    ``trainer.callbacks``."""
    found = []
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        module, _, name = str(callback.get("class_path", "")).rpartition(".")
        cls = getattr(import_module(module), name, None) if module else None  # imported while parsing
        if (
            isinstance(cls, type)
            and issubclass(cls, ModelCheckpoint)
            and callback.get("init_args") is not None
        ):
            found.append(callback.init_args)
    return found


def checkpoint_callbacks(config: Any, groups: Sequence[str] = ()) -> list[Any]:
    """The init arguments of a parsed config's checkpoint callbacks: its option ``groups`` that hold a
    ``ModelCheckpoint``'s (``checkpoint``), then those listed in ``trainer.callbacks``."""
    return [config[key] for key in groups if config.get(key) is not None] + listed_checkpoints(config)


def is_on(args: Any) -> bool:
    """Whether a checkpoint callback's arguments let it write anything (``save_top_k 0`` turns one off)."""
    return args.get("save_top_k") != 0 or bool(args.get("save_last"))


def writes_last(args: Any) -> bool:
    return args.get("filename") == "last" or bool(args.get("save_last"))


def folders_of(saving: list[Any]) -> dict[str, str | None]:
    """Where last.ckpt goes (the checkpoint callback named ``last`` or with ``save_last``) and the best one (the
    one with a monitor)."""
    folders: dict[str, str | None] = {"last": None, "best": None}
    for args in filter(is_on, saving):
        for role in ("last",) * writes_last(args) + ("best",) * (args.get("monitor") is not None):
            folders[role] = folders[role] or args.get("dirpath")
    return folders


SPECIAL_CKPT_PATHS = ("hpc", "registry")  # --ckpt_path values Lightning resolves itself (not last, best)


def flattened(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (``images.size``); tuples become lists."""
    if hasattr(tree, "as_dict"):
        tree = tree.as_dict()
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flattened(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: list(tree) if isinstance(tree, tuple) else tree}


def _differences(given: dict[str, Any], saved: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, given[k], saved[k]) for k in sorted(given.keys() & saved.keys()) if given[k] != saved[k]]


def refuse_earlier_checkpoints(dirpath: str | None, parser: Any) -> None:
    """Refuse a fresh ``fit`` into a folder that holds checkpoints (the same names would be overwritten)."""
    if not dirpath or not os.path.isdir(dirpath):
        return
    found = sorted(name for name in os.listdir(dirpath) if name.endswith(".ckpt"))
    if not found:
        return
    folder = os.path.normpath(dirpath)
    in_run_dir = os.path.basename(folder) == "checkpoints"  # <run dir>/checkpoints: the CLI's default
    base = os.path.dirname(folder) if in_run_dir else folder
    free = next(f"{base}-{n}" for n in range(2, 10_000) if not os.path.exists(f"{base}-{n}"))
    where = (
        f"--trainer.default_root_dir {free}" if in_run_dir else f"dirpath: {free} in its checkpoint callbacks"
    )
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    parser.error(
        f"{dirpath} already holds an earlier run's checkpoints ({shown}); this run would replace them. Resume that"
        f" run with --ckpt_path last, start this one in its own folder with {where}, or delete the folder first."
    )


def check_sharded_resume(ckpt_path: str | None, strategy: Any) -> None:
    """Refuse a ``fit`` that would resume a sharded checkpoint under a strategy that cannot restore its shards
    (the optimizer's state is sharded by parameter name; DDP and one device read a whole file)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from mm_lightning.checkpoints.sharded import is_sharded_checkpoint

    if ckpt_path and is_sharded_checkpoint(ckpt_path) and not isinstance(strategy, ModelParallelStrategy):
        raise CheckpointFileError(
            f"--ckpt_path {ckpt_path} is a sharded checkpoint: a fit resumes it under the sharded strategy"
            f" (--config configs/fsdp2.yaml), not {type(strategy).__name__}; validate, test, predict and evaluate"
            " read it under any strategy."
        )


def check_run_folder(
    cli_config: Any, parser: Any, command_line: Sequence[str] = (), checkpoint_groups: Sequence[str] = ()
) -> RunDataOptions | None:
    """Default the checkpoint folders, then :func:`check_resume` (a parsed config of the CLI, its parser, the
    arguments it parsed, the option groups that hold checkpoint callbacks); returns the run's data options an
    evaluation of a checkpoint carried over."""
    subcommand = cli_config.get("subcommand")
    default_checkpoint_dirs(cli_config[subcommand] if subcommand else cli_config, parser, checkpoint_groups)
    return check_resume(cli_config, parser, command_line, checkpoint_groups)


def default_checkpoint_dirs(config: Any, parser: Any, groups: Sequence[str] = ()) -> None:
    """Default a checkpoint callback's ``dirpath`` to last.ckpt's, or else to ``<run dir>/checkpoints``."""
    if groups and (config.get("trainer") or {}).get("enable_checkpointing") is False:
        # Lightning refuses a ModelCheckpoint beside it, and the groups always build theirs
        off = " ".join(f"--{group}.save_top_k 0" for group in groups)
        parser.error(
            f"--trainer.enable_checkpointing false: turn the checkpoint callbacks off with {off} instead"
        )
    saving = checkpoint_callbacks(config, groups)
    for args in filter(is_on, saving):
        if args.get("filename") == "last" and args.get("monitor") is not None:
            parser.error(
                "the ModelCheckpoint that writes last.ckpt has a monitor: last.ckpt would hold the best step,"
                " not the latest; set the monitor on best_checkpoint (--best_checkpoint.monitor) instead"
            )
    refuse_listed_copies(config, parser, groups)
    run_dir = config.get("trainer", {}).get("default_root_dir")
    folder = folders_of(saving)["last"] or (os.path.join(run_dir, "checkpoints") if run_dir else None)
    for args in saving:
        if args.get("dirpath") is None:
            args.dirpath = folder


def refuse_listed_copies(config: Any, parser: Any, groups: Sequence[str]) -> None:
    """Refuse a ``ModelCheckpoint`` in ``trainer.callbacks`` that does a checkpoint group's work (a copy of an
    older callbacks file, say): two would write the same files, and Lightning refuses two alike."""
    active = {key: config[key] for key in groups if config.get(key) is not None and is_on(config[key])}
    for args in filter(is_on, listed_checkpoints(config)):
        same = [
            key
            for key, group in active.items()
            if (writes_last(args) and writes_last(group))
            or (args.get("monitor") is not None and args.get("monitor") == group.get("monitor"))
        ]
        if same:
            parser.error(
                f"trainer.callbacks lists a ModelCheckpoint (filename {args.get('filename')!r}, monitor"
                f" {args.get('monitor')!r}) that does the work of the {same[0]} option group: drop it from the list"
                f" and set the group's options instead (--{same[0]}.every_n_train_steps, ...;"
                f" mm_lightning/callbacks/checkpoints.yaml), or turn the group off with --{same[0]}.save_top_k 0"
            )


def check_resume(
    cli_config: Any, parser: Any, command_line: Sequence[str] = (), checkpoint_groups: Sequence[str] = ()
) -> RunDataOptions | None:
    """Right after parsing: resolve ``--ckpt_path last``/``best`` in the run's checkpoint folder (or refuse),
    refuse a fresh ``fit`` over an earlier run's checkpoints, check the file and what it records, refuse a resume
    with nothing left to train, carry the run's data options into ``test``/``validate``/``predict``
    (:func:`carry_run_data_options`), and warn about the options the checkpoint replaces or that differ from it."""
    subcommand = cli_config.get("subcommand")
    if not subcommand:
        return None
    config = cli_config[subcommand]
    ckpt_path = config.get("ckpt_path")
    folders = folders_of(checkpoint_callbacks(config, checkpoint_groups))
    wanted, other = ("best", "last") if ckpt_path == "best" else ("last", "best")
    dirpath = folders[wanted] or folders[other]
    if subcommand == "fit" and not ckpt_path:
        refuse_earlier_checkpoints(dirpath, parser)
    if not ckpt_path:
        return None
    if ckpt_path in ("last", "best") and not os.path.isfile(ckpt_path):
        if dirpath is None:
            parser.error(
                f"--ckpt_path {ckpt_path}: the run has no checkpoint callback to say where its checkpoints are;"
                " keep the default ones (--checkpoint.save_top_k 1) or give the checkpoint's path"
            )
        try:
            found = run_checkpoint(ckpt_path, dirpath, fresh_ok=subcommand == "fit")
        except ExplainedError as err:
            parser.error(f"--ckpt_path {ckpt_path}: {err}")
        if found is None:
            refuse_earlier_checkpoints(
                dirpath, parser
            )  # other checkpoints there: this run would replace them
            rank_zero_info(f"--ckpt_path last: no checkpoint in {dirpath} yet; starting a new run")
            config.ckpt_path = None
            return None
        config.ckpt_path = ckpt_path = found
    elif ckpt_path in SPECIAL_CKPT_PATHS and not os.path.isfile(ckpt_path):
        return None  # Lightning resolves it
    from mm_lightning.checkpoints.loading import checked_resume_file

    try:  # before LightningCLI parses what the checkpoint records into the model's options
        content = checked_resume_file(ckpt_path, config.get("model") or {})
    except ExplainedError as err:
        parser.error(f"--ckpt_path: {err}")
    trainer = config.get("trainer") or {}
    finished = subcommand == "fit" and nothing_left_to_train(
        content, trainer.get("max_steps"), trainer.get("max_epochs"), trainer.get("max_time")
    )
    if finished:
        parser.error(f"--ckpt_path {ckpt_path}: {finished}")
    carried = None
    if subcommand != "fit":
        carried = carry_run_data_options(config, content, command_line_data_keys(command_line))
        if carried.carried:
            rank_zero_info(
                f"{subcommand} with {ckpt_path}: the run's data options replace the config's: "
                + ", ".join(
                    f"data.{k} {run!r} (config {given!r})" for k, (given, run) in carried.carried.items()
                )
            )
    warn_if_overridden(cli_config, parser, content, str(ckpt_path))
    return carried


def _data_options(data: Any) -> dict[str, Any]:
    """The given data options, a MultimodalDataModule's groups filled in from their defaults: a key left out
    is its default, which a checkpoint's value may differ from."""
    from mm_lightning.data.config import recorded_options
    from mm_lightning.data.datamodule import MultimodalDataModule

    options = data.get("init_args", data) if data is not None else None
    if options is None:
        return {}
    options = options.as_dict() if hasattr(options, "as_dict") else dict(options)
    # the class jsonargparse loaded for this config (looked up, not imported)
    module, _, name = str(data.get("class_path", "")).rpartition(".")
    data_class = getattr(sys.modules.get(module), name, None)
    if isinstance(data_class, type) and issubclass(data_class, MultimodalDataModule):
        try:
            return recorded_options(options)
        except (TypeError, ValueError):  # a subclass's group with keys of its own: compare what was given
            pass
    return options


# The data options that decide what an evaluation scores: with a checkpoint, ``test``, ``validate`` and
# ``predict`` take the run's values of these unless the command line gives one (the tokenizer and the image
# tower's preprocessing already follow the checkpoint's model). The checks of untrusted files (max_pixels,
# confine_to_root) stay the config's: a run's looser setting must not loosen an evaluation's.
RUN_DATA_OPTIONS = (
    "image_key",
    "text_key",
    "max_length",
    "images.size",
    "images.mean",
    "images.std",
    "images.reduced_decode",
    "loader.pad_to_multiple_of",
)


@dataclass
class RunDataOptions:
    """What an evaluation of a checkpoint did with the run's data options: ``carried`` replaced a config's or a
    default value (key: (that value, the run's)); ``differing`` were given on the command line and differ from
    the run's (key: (given, the run's))."""

    carried: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    differing: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def command_line_data_keys(args: Sequence[str]) -> set[str]:
    """The data options an argument list sets by name (``--data.init_args.images.size 64`` → ``images.size``);
    a whole group given (``--data.init_args.images '{...}'``) names the group."""
    keys = set()
    for arg in args:
        if not (isinstance(arg, str) and arg.startswith("--data.")):
            continue
        key = arg[len("--data.") :].split("=", 1)[0].removesuffix("+")
        keys.add(key.removeprefix("init_args."))
    return keys


def _given_on_command_line(key: str, explicit: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:n]) in explicit for n in range(1, len(parts) + 1))


def carry_run_data_options(config: Any, content: dict[str, Any], explicit: set[str]) -> RunDataOptions:
    """Set :data:`RUN_DATA_OPTIONS` to the checkpoint's values, except those ``explicit`` (given on the command
    line), so that a run is scored under the protocol it was trained with whatever config file is given."""
    found = RunDataOptions()
    data = config.get("data")
    options = data.get("init_args", data) if data is not None else None
    saved = flattened(content.get("datamodule_hyper_parameters") or {})
    if options is None or not saved:
        return found
    current = flattened(_data_options(data))
    for key in RUN_DATA_OPTIONS:
        group, _, name = key.rpartition(".")
        if key not in saved or key not in current or current[key] == saved[key]:
            continue  # an option this data module does not take, or one the run did not record
        if _given_on_command_line(key, explicit):
            found.differing[key] = (current[key], saved[key])
            continue
        found.carried[key] = (current[key], saved[key])
        if group:
            options[group] = {**(options.get(group) or {}), name: saved[key]}
        else:
            options[key] = saved[key]
    return found


def warn_if_overridden(cli_config: Any, parser: Any, content: dict[str, Any], path: str) -> None:
    """Warn once, listing the model options the checkpoint replaces (as LightningCLI will, right after parsing)
    and the data options that differ from the checkpoint's: every one when resuming ``fit``, else those that
    decide what is scored (:data:`RUN_DATA_OPTIONS`, left as given only when the command line gave them)."""
    subcommand = cli_config.subcommand
    config = cli_config[subcommand]
    hparams = {k: v for k, v in (content.get("hyper_parameters") or {}).items() if k != "_instantiator"}
    replaced = []
    if hparams and "_class_path" not in hparams:
        final = parser.parse_object({subcommand: {"model": hparams}}, cli_config)
        replaced = _differences(flattened(config.get("model")), flattened(final[subcommand].get("model")))
    given_data = flattened(_data_options(config.get("data")))
    if subcommand != "fit":
        given_data = {k: v for k, v in given_data.items() if k in RUN_DATA_OPTIONS}
    differing_data = _differences(given_data, flattened(content.get("datamodule_hyper_parameters", {})))
    if not replaced and not differing_data:
        return
    lines = [f"Resuming from {path}:" if subcommand == "fit" else f"{subcommand} with {path}:"]
    if replaced:
        lines.append("  the checkpoint's model options replace the given ones (the weights need them):")
        lines += [f"    model.{k}: given {g!r}, used {s!r}" for k, g, s in replaced]
    if differing_data:
        lines.append(
            "  data options differ from the checkpoint's (the given ones are used):"
            if subcommand == "fit"
            else "  data options given on the command line differ from the run's (the given ones are used, so"
            " the figures are not the run's protocol):"
        )
        lines += [f"    data.{k}: given {g!r}, checkpoint {s!r}" for k, g, s in differing_data]
    rank_zero_warn("\n".join(lines))
