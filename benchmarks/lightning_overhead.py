"""Per-step cost of Lightning and of the CLI's default callbacks on the demo model, vs a plain PyTorch loop.

    python benchmarks/lightning_overhead.py [--steps 40] [--warmup 8] [--rounds 2] [--threads 2] [--no-attribute]

Same model (``configs/demo.yaml``, same initial weights), same optimizer and LR schedule (the module's own
``configure_optimizers``), same in-memory batches (taken once from the demo datamodule), one epoch of
``--steps`` steps, no validation. Runs, rounds alternating (best round counts, load from other processes hits
all alike):
  plain:   ``training_step`` -> ``backward`` -> ``optimizer.step`` -> ``scheduler.step`` in a for loop;
  bare:    ``Trainer.fit`` with no logger, no callbacks, no progress bar (Lightning itself + the module's hooks);
  default: ``Trainer.fit`` with the trainer the CLI builds from ``configs/demo.yaml`` (TensorBoard logger,
           progress bar and every default callback group);
  and, with attribution on, the bare trainer + the TensorBoard logger + one default callback at a time.
A step's time is the wall time between consecutive ``on_train_batch_start`` calls (loop iterations for plain),
so every hook and periodic cost (logging every N steps, checkpoints) is counted; the first ``--warmup`` steps
are not. Last line: ``RESULT lightning_overhead ratio=<default/plain mean step time>``; target <= 1.05.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mm_lightning.cli import cli_main  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


class StepClock(pl.Callback):
    """Records the wall time at every training batch start (put first so it sees the whole step)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self.stamps.append(time.perf_counter())


def step_times(stamps: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)]


class Harness:
    """Builds the CLI's model/trainer for the demo config and the shared in-memory batches."""

    def __init__(self, steps: int, root: Path) -> None:
        self.steps, self.root = steps, root
        cli = self.cli()
        datamodule = cli.datamodule
        datamodule.prepare_data()
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
        self.batches: list[dict] = []
        while len(self.batches) < steps:
            for batch in loader:
                self.batches.append(datamodule.normalize_batch(batch))  # model-ready, as after transfer
                if len(self.batches) == steps:
                    break
        self.initial = copy.deepcopy(cli.model.state_dict())
        self.callback_names = [type(c).__name__ for c in cli.trainer.callbacks]

    def cli(self) -> object:
        args = [
            "--config", str(CONFIG),
            "--data.init_args.data_dir", str(self.root / "demo"),
            "--data.init_args.num_workers", "0",
            "--trainer.logger.init_args.save_dir", str(self.root / "logs"),
            "--trainer.default_root_dir", str(self.root / "run"),
            "--trainer.max_epochs", "1",
            "--trainer.max_steps", str(self.steps),
        ]  # fmt: skip
        return cli_main(args, run=False)

    def model(self, cli: object | None = None) -> pl.LightningModule:
        model = (cli or self.cli()).model
        model.load_state_dict(self.initial)
        return model

    def loader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, shuffle=False)

    def plain(self, warmup: int) -> list[float]:
        model = self.model()
        # configure_optimizers reads only the number of steps from the trainer; give it just that.
        model._trainer = SimpleNamespace(estimated_stepping_batches=self.steps)
        config = model.configure_optimizers()
        model._trainer = None
        optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
        model.train()
        stamps = []
        for i, batch in enumerate(self.batches):
            stamps.append(time.perf_counter())
            loss = model.training_step(batch, i)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        stamps.append(time.perf_counter())
        return step_times(stamps, warmup)

    def fit(self, warmup: int, kind: str) -> list[float]:
        """``kind``: "bare", "default", "logger" or "logger+<callback class name>"."""
        clock = StepClock()
        cli = self.cli()
        model = self.model(cli)
        if kind == "default":
            trainer = cli.trainer
            trainer.callbacks.insert(0, clock)
        else:
            _, _, wanted = kind.partition("+")
            callbacks = [clock] + [c for c in cli.trainer.callbacks if type(c).__name__ == wanted]
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=self.steps,
                max_epochs=1,
                logger=cli.trainer.logger if kind.startswith("logger") else False,
                callbacks=callbacks,
                enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
                enable_progress_bar=wanted.endswith("ProgressBar"),
                enable_model_summary=False,
                log_every_n_steps=cli.trainer.log_every_n_steps,
                precision=cli.trainer.precision,
            )
        trainer.fit(model, train_dataloaders=self.loader())
        clock.stamps.append(time.perf_counter())  # end of the last step (fit returned)
        return step_times(clock.stamps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-attribute", action="store_true", help="skip the per-callback runs")
    parser.add_argument(
        "--callbacks", help="comma-separated callback class names to attribute (default: all)"
    )
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_overhead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    harness = Harness(args.steps, args.data)
    kinds = ["plain", "bare", "default"]
    if not args.no_attribute:
        wanted = args.callbacks.split(",") if args.callbacks else harness.callback_names
        kinds += ["logger"] + [f"logger+{name}" for name in wanted]
    print(f"default callbacks: {', '.join(harness.callback_names)}", flush=True)
    best: dict[str, tuple[float, float]] = {}  # kind -> (mean, median) ms of the best round
    for r in range(args.rounds):
        for kind in kinds:
            times = harness.plain(args.warmup) if kind == "plain" else harness.fit(args.warmup, kind)
            mean, median = 1000 * statistics.fmean(times), 1000 * statistics.median(times)
            if kind not in best or mean < best[kind][0]:
                best[kind] = (mean, median)
            print(f"round {r} {kind:36s} mean {mean:7.1f} ms  median {median:7.1f} ms per step", flush=True)
    plain = best["plain"][0]
    print("\nbest round, per step (mean / median), and vs plain:")
    for kind, (mean, median) in best.items():
        print(f"  {kind:36s} {mean:7.1f} / {median:7.1f} ms  {mean / plain:5.3f}x")
    if not args.no_attribute:
        base = best["logger"][0]
        costs = {k.split("+", 1)[1]: best[k][0] - base for k in kinds if k.startswith("logger+")}
        print("cost of each default callback on top of bare + TensorBoard logger (ms per step, mean):")
        for name, cost in sorted(costs.items(), key=lambda kv: -kv[1]):
            print(f"  {name:30s} {cost:+7.2f}")
    d, b = best["default"][0], best["bare"][0]
    print(
        f"RESULT lightning_overhead ratio={d / plain:.3f} (default callbacks {d:.1f} ms/step vs plain loop "
        f"{plain:.1f}; bare Trainer {b:.1f} ({b / plain:.3f}x); demo model, {args.steps} steps "
        f"({args.warmup} warm-up not counted), {args.threads} threads, best of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
