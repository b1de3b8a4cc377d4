"""What a run produced, printed when it ends: its checkpoints with their SHA-256, the last metrics, and the commands
that train it further, test and evaluate it."""

from __future__ import annotations

import os

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from mm_lightning.checkpoints.files import further_limits, sha256_of


def _checkpoint_option(best: ModelCheckpoint | None, last: str) -> str:
    """What ``--ckpt_path`` names to test the run: ``best`` or ``last`` where the run folder resolves them (so the
    command stays right after training further replaces the best file), else the file's path."""
    if best is not None:
        one_best = best.save_top_k == 1 and os.path.basename(best.best_model_path).startswith("best")
        return "best" if one_best else best.best_model_path
    return "last" if os.path.basename(last) == "last.ckpt" else last


def _log_dir(trainer: Trainer) -> str | None:
    """The logger's folder of this run (``trainer.log_dir`` is a collective: every rank would have to ask)."""
    logger = trainer.logger
    return None if logger is None else getattr(logger, "log_dir", None) or logger.save_dir


def _sha256(path: str) -> list[str]:
    """The line with a checkpoint file's SHA-256, so that figures name exactly the file they came from."""
    return [f"    SHA-256 {sha256_of(path)}"] if os.path.exists(path) else []


def _train_further(trainer: Trainer) -> tuple[str, str]:
    """(what, options) that resume the run for as long again: the limits it reached, raised."""
    max_epochs = -1 if trainer.max_epochs is None else trainer.max_epochs
    reached = further_limits(trainer.global_step, trainer.current_epoch, trainer.max_steps, max_epochs)
    if not reached:
        return "", ""  # stopped before its limits: the same command continues it
    more = {"steps": trainer.max_steps, "epochs": trainer.max_epochs}
    what = " and ".join(f"{more[unit]} more {unit if more[unit] != 1 else unit[:-1]}" for unit in reached)
    return f" ({what})", "".join(f" --trainer.max_{unit} {total}" for unit, total in reached.items())


def metrics_line(trainer: Trainer, prefix: str) -> str:
    """``name value`` pairs of the logged metrics under ``prefix`` (recalls at 1 and the loss first)."""
    values = {
        k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix) and v.numel() == 1
    }
    first = [k for k in (f"{prefix}r1_t2i", f"{prefix}r1_i2t", f"{prefix}loss") if k in values]
    return "  ".join(f"{k} {values[k]:.4f}" for k in [*first, *sorted(values.keys() - set(first))])


class RunSummary(Callback):
    """Prints what the run produced when ``fit``, ``validate`` or ``test`` ends (rank 0)."""

    @override
    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        lines = [f"Finished fit at step {trainer.global_step}."]
        checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        best = next((c for c in checkpoints if c.monitor and c.best_model_path), None)
        # a callback without a monitor keeps the latest checkpoint as its "best" (the CLI's: last.ckpt)
        saved = [c.last_model_path or ("" if c.monitor else c.best_model_path) for c in checkpoints]
        last = next((path for path in saved if path), "")
        log_dir = _log_dir(trainer)
        config = os.path.join(log_dir, "config.yaml") if log_dir else None
        if best is not None:
            score = best.best_model_score
            value = f"{best.monitor}: {float(score):.4f}  " if score is not None and best.monitor else ""
            lines += [f"  best {value}{best.best_model_path}", *_sha256(best.best_model_path)]
        if last:
            lines += [f"  last checkpoint: {last}", *_sha256(last)]
        validated = metrics_line(trainer, "val/")
        if validated:
            lines.append(f"  last validation: {validated}")
        if log_dir:
            lines.append(f"  logs: {log_dir}  (tensorboard --logdir {os.path.dirname(log_dir)})")
        if config and os.path.exists(config):
            tested = _checkpoint_option(best, last)
            more = _train_further(trainer)
            lines.append(
                f"  train further{more[0]}: python -m mm_lightning fit --config {config} --ckpt_path last{more[1]}"
            )
            if tested:
                lines.append(f"  test it: python -m mm_lightning test --config {config} --ckpt_path {tested}")
            if tested and getattr(trainer.datamodule, "files", {}).get("test"):
                output = os.path.join(log_dir, "evaluation")
                lines.append(
                    f"  evaluate it: python -m mm_lightning evaluate --config {config} --ckpt_path {tested}"
                    f" --output {output}"
                )
        print("\n".join(lines), flush=True)

    @override
    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._evaluated(trainer, "validate", "val/")

    @override
    @rank_zero_only
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluated(trainer, "test", "test/")

    @staticmethod
    def _evaluated(trainer: Trainer, stage: str, prefix: str) -> None:
        lines = [f"Finished {stage}: {metrics_line(trainer, prefix) or 'no metric logged'}"]
        if trainer.ckpt_path:
            lines += [f"  checkpoint: {trainer.ckpt_path}", *_sha256(trainer.ckpt_path)]
        if _log_dir(trainer):
            lines.append(f"  logs: {_log_dir(trainer)}")
        print("\n".join(lines), flush=True)
