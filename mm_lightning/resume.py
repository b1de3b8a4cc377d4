"""What the CLI does with ``--ckpt_path`` before Lightning loads it: check the file, say which options it overrides.

* ``--ckpt_path last`` is resolved to ``<run dir>/checkpoints/last.ckpt`` here, so that it behaves exactly like
  an explicit path (LightningCLI applies a checkpoint's model hyperparameters only for an existing file).
* An unusable file (missing, empty, text, truncated, not written by Lightning) is a parser error naming the file
  and the problem, instead of ``EOFError`` or ``KeyError`` from inside Lightning.
* LightningCLI replaces the model options with the checkpoint's (the weights only fit the architecture they were
  trained with); data options are taken as given. Both are reported in one warning when they differ.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from mm_lightning.plugins.io import CheckpointFileError, check_checkpoint_file

# Values of --ckpt_path that Lightning resolves itself (besides "last", resolved here).
SPECIAL_CKPT_PATHS = ("best", "hpc", "registry")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if hasattr(tree, "as_dict"):
        tree = tree.as_dict()
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: list(tree) if isinstance(tree, tuple) else tree}


def _differences(given: dict[str, Any], saved: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, given[k], saved[k]) for k in sorted(given.keys() & saved.keys()) if given[k] != saved[k]]


def refuse_earlier_checkpoints(dirpath: str | None, parser: Any) -> None:
    """A new ``fit`` never replaces another run's checkpoints: refuse a checkpoint folder that already holds some.

    Checkpoint names repeat from run to run (``last.ckpt``, ``best-{epoch}-{step}.ckpt``), so a second run into the
    same folder would overwrite the first one's, and ``predict`` or ``--ckpt_path last`` would then silently use
    another model. The message says how to resume that run or where to start this one.

    Args:
        dirpath: The checkpoint folder (``None``: not known here, nothing to check).
        parser: The parser, for a clean error exit.
    """
    if not dirpath or not os.path.isdir(dirpath):
        return
    found = sorted(name for name in os.listdir(dirpath) if name.endswith(".ckpt"))
    if not found:
        return
    folder = os.path.normpath(dirpath)
    in_run_dir = os.path.basename(folder) == "checkpoints"  # <run dir>/checkpoints: the CLI's default
    base = os.path.dirname(folder) if in_run_dir else folder
    free = next(f"{base}-{n}" for n in range(2, 10_000) if not os.path.exists(f"{base}-{n}"))
    option = "--trainer.default_root_dir" if in_run_dir else "--checkpoint.dirpath"
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    parser.error(
        f"{dirpath} already holds an earlier run's checkpoints ({shown}); this run would replace them. Resume that"
        f" run with --ckpt_path last, start this one in its own folder with {option} {free}, or delete the folder"
        " first."
    )


class ResumeOverrides:
    """Checks ``--ckpt_path`` right after parsing and warns, before instantiation, about overridden options."""

    def __init__(self) -> None:
        self.given_model: dict[str, Any] = {}
        self.saved_data: dict[str, Any] = {}
        self.path: str | None = None

    def before_checkpoint_hparams(self, cli: Any, parser: Any) -> None:
        """Resolve ``last``, check the checkpoint file, remember the given model options.

        Args:
            cli: The ``LightningCLI`` (its ``config`` was just parsed).
            parser: The parser, for a clean error exit.
        """
        subcommand = cli.config.get("subcommand")
        if not subcommand or subcommand == "audit":
            return
        config = cli.config[subcommand]
        ckpt_path = config.get("ckpt_path")
        dirpath = ((config.get("checkpoint") or {}).get("init_args") or {}).get("dirpath")
        if subcommand == "fit" and not ckpt_path:
            refuse_earlier_checkpoints(dirpath, parser)
        if not ckpt_path or ckpt_path in SPECIAL_CKPT_PATHS:
            return
        if ckpt_path == "last":
            last = os.path.join(dirpath, "last.ckpt") if dirpath else None
            if last is None or not os.path.exists(last):
                return  # Lightning looks for it and says so when there is none
            config.ckpt_path = ckpt_path = last
        try:
            content = check_checkpoint_file(ckpt_path)
        except CheckpointFileError as err:
            parser.error(f"--ckpt_path: {err}")
        self.path = str(ckpt_path)
        self.given_model = _flatten(config.get("model"))
        self.saved_data = _flatten(content.get("datamodule_hyper_parameters", {}))

    def warn_if_overridden(self, cli: Any) -> None:
        """Warn once, listing the model options the checkpoint replaced and the data options that differ from it.

        Args:
            cli: The ``LightningCLI`` after LightningCLI applied the checkpoint's hyperparameters.
        """
        if self.path is None:
            return
        config = cli.config[cli.config.subcommand]
        final_model = _flatten(config.get("model"))
        replaced = _differences(self.given_model, final_model)
        data = config.get("data")
        given_data = _flatten(data.get("init_args", data) if data is not None else {})
        differing_data = _differences(given_data, self.saved_data)
        if not replaced and not differing_data:
            return
        lines = [f"Resuming from {self.path}:"]
        if replaced:
            lines.append("  the checkpoint's model options replace the given ones (the weights need them):")
            lines += [f"    model.{k}: given {g!r}, used {s!r}" for k, g, s in replaced]
        if differing_data:
            lines.append("  data options differ from the checkpoint's (the given ones are used):")
            lines += [f"    data.{k}: given {g!r}, checkpoint {s!r}" for k, g, s in differing_data]
        rank_zero_warn("\n".join(lines))
