"""Per-step cost of Lightning and of the CLI's default callbacks on the demo model, vs a plain PyTorch loop.

    python benchmarks/lightning_overhead.py [--steps 30] [--warmup 5] [--rounds 3] [--threads 1]

Same model (``configs/demo.yaml``, same initial weights), same optimizer and LR schedule (the module's own
``configure_optimizers``), same in-memory batches (taken once from the demo datamodule, already normalized),
fp32, one epoch, no validation, the same ``torch.set_num_threads`` everywhere. Runs:

  plain:   ``training_step`` -> ``zero_grad`` -> ``backward`` (the module's, which closes its one-time FLOPs
           count exactly as under the Trainer) -> the module's per-tower clipping (``clip_grouped``, what its
           ``configure_gradient_clipping`` runs) -> ``optimizer.step`` -> ``scheduler.step``, in a for loop;
  bare:    ``Trainer.fit`` with no logger, no callbacks, no progress bar (Lightning itself + the module's hooks);
  default: ``Trainer.fit`` with the trainer the CLI builds from ``configs/demo.yaml`` (TensorBoard logger, rich
           progress bar and every default callback group).

Rounds interleave the runs (plain, bare, default, plain, ...) so that load from other processes on a shared
machine hits all alike. A step is the interval between two consecutive batch starts (``on_train_batch_start``,
or the loop iteration for plain), so every per-step hook and periodic cost (TensorBoard writes every
``log_every_n_steps``, ...) is inside it; the last batch's interval, which would contain the end of ``fit``
(epoch-end checkpoint, teardown), is not measured, nor are the first ``--warmup`` steps. Each run reports the
median over its steps of the wall time and of the process CPU time (all threads; robust to other processes
competing for the cores); the result is the median over rounds of those per-run medians.

Attribution: one more default run under Lightning's ``SimpleProfiler`` gives the time of every callback hook per
step (the callbacks' own code, nothing else), plus the TensorBoard logger's ``log_metrics`` and the module's
``self.log`` calls, timed by wrapping them. Last line: ``RESULT lightning_overhead ratio=<default/plain>``
(median CPU time per step); target <= 1.05.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import SimpleProfiler
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mm_lightning.cli import cli_main  # noqa: E402
from mm_lightning.models.optim import clip_grouped  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
# Callback hooks that run once per training step (the rest run once per fit or epoch).
STEP_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)


class StepClock(pl.Callback):
    """Records wall and process CPU time at every training batch start (put first so it sees the whole step)."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []

    def on_train_batch_start(self, *args: object) -> None:
        self.stamps.append((time.perf_counter(), time.process_time()))


def step_medians(stamps: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds between consecutive stamps, after ``warmup`` steps."""
    pairs = list(zip(stamps[warmup:], stamps[warmup + 1 :], strict=False))
    wall = statistics.median(b[0] - a[0] for a, b in pairs)
    cpu = statistics.median(b[1] - a[1] for a, b in pairs)
    return wall, cpu


class CallTimer:
    """Wraps callables and adds up their wall time (only while ``active``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed


class Harness:
    """Builds the CLI's model/trainer for the demo config and the shared in-memory batches."""

    def __init__(self, steps: int, root: Path) -> None:
        self.steps, self.root = steps, root
        self.batches_per_run = steps + 1  # the last batch's interval (end of fit) is not measured
        cli = self.cli()
        datamodule = cli.datamodule
        datamodule.prepare_data()
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
        self.batches: list[dict] = []
        while len(self.batches) < self.batches_per_run:
            for batch in loader:
                self.batches.append(datamodule.normalize_batch(batch))  # model-ready, as after transfer
                if len(self.batches) == self.batches_per_run:
                    break
        self.initial = copy.deepcopy(cli.model.state_dict())
        self.callback_names = [type(c).__name__ for c in cli.trainer.callbacks]
        self.precision = cli.trainer.precision
        assert self.precision == "32-true", "the plain loop runs fp32"
        assert cli.trainer.gradient_clip_val is None, "the plain loop does no global clipping"
        assert cli.trainer.accumulate_grad_batches == 1, "the plain loop steps every batch"

    def cli(self) -> Any:
        args = [
            "--config", str(CONFIG),
            "--data.init_args.data_dir", str(self.root / "demo"),
            "--data.init_args.num_workers", "0",
            "--trainer.default_root_dir", str(self.root / "run"),
            "--trainer.max_epochs", "1",
            "--trainer.max_steps", str(self.batches_per_run),
        ]  # fmt: skip
        return cli_main(args, run=False)

    def model(self, cli: Any | None = None) -> pl.LightningModule:
        model = (cli or self.cli()).model
        model.load_state_dict(self.initial)
        return model

    def loader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, shuffle=False)

    def plain(self, warmup: int) -> tuple[float, float]:
        model = self.model()
        # configure_optimizers reads only the number of steps from the trainer; give it just that.
        model._trainer = SimpleNamespace(estimated_stepping_batches=self.batches_per_run)
        config = model.configure_optimizers()
        model._trainer = None
        optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
        clip_groups = {  # what the module's configure_gradient_clipping clips (nothing with the demo config)
            "image_encoder": (model.image_encoder, model.image_config.clip_norm),
            "text_encoder": (model.text_encoder, model.text_config.clip_norm),
        }
        model.train()
        stamps = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a trainer warns and does nothing
            for i, batch in enumerate(self.batches):
                stamps.append((time.perf_counter(), time.process_time()))
                loss = model.training_step(batch, i)
                optimizer.zero_grad(set_to_none=True)
                model.backward(loss)
                clip_grouped({k: (m.parameters(), c) for k, (m, c) in clip_groups.items()})
                optimizer.step()
                scheduler.step()
        return step_medians(stamps, warmup)

    def fit(self, warmup: int, kind: str, timer: CallTimer | None = None) -> tuple[float, float]:
        """``kind``: "bare" or "default"; with ``timer``, the default run is profiled hook by hook."""
        clock = StepClock()
        cli = self.cli()
        model = self.model(cli)
        if kind == "default":
            trainer = cli.trainer
            trainer.callbacks.insert(0, clock)
        else:
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=self.batches_per_run,
                max_epochs=1,
                logger=False,
                callbacks=[clock],
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                precision=self.precision,
            )
        if timer is not None:
            trainer.profiler = SimpleProfiler(dirpath=self.root, filename="profile")
            trainer.logger.log_metrics = timer.wrap(
                "TensorBoardLogger.log_metrics", trainer.logger.log_metrics
            )
            model.log = timer.wrap("LightningModule.log (all calls)", model.log)
            clock.on_train_batch_start = _activate_after(clock.on_train_batch_start, timer, warmup, clock)
        trainer.fit(model, train_dataloaders=self.loader())
        if timer is not None:
            self.profile = trainer.profiler.recorded_durations
        return step_medians(clock.stamps, warmup)


def _activate_after(fn: Callable[..., Any], timer: CallTimer, warmup: int, clock: StepClock) -> Callable:
    def hook(*args: Any) -> None:
        fn(*args)
        timer.active = len(clock.stamps) > warmup

    return hook


def hook_costs(durations: dict[str, list[float]], warmup: int, steps: int) -> dict[str, float]:
    """Seconds per measured step spent in each callback class's per-step hooks."""
    costs: dict[str, float] = defaultdict(float)
    for action, times in durations.items():
        if not action.startswith("[Callback]"):
            continue
        key, _, hook = action[len("[Callback]") :].rpartition(".")
        if hook in STEP_HOOKS and key.split("{")[0] != "StepClock":
            # one call per batch: drop the warm-up steps and the unmeasured last batch
            costs[key.split("{")[0]] += sum(times[warmup:steps]) / max(steps - warmup, 1)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="measured batches per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-attribute", action="store_true", help="skip the profiled run")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_overhead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    harness = Harness(args.steps, args.data)
    print(f"default callbacks: {', '.join(harness.callback_names)}", flush=True)
    kinds = ["plain", "bare", "default"]
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in range(args.rounds):
        for kind in kinds:
            wall, cpu = harness.plain(args.warmup) if kind == "plain" else harness.fit(args.warmup, kind)
            runs[kind].append((wall, cpu))
            print(
                f"round {r} {kind:8s} median wall {1000 * wall:7.1f} ms  cpu {1000 * cpu:7.1f} ms", flush=True
            )
    med = {k: tuple(1000 * statistics.median(x[i] for x in v) for i in (0, 1)) for k, v in runs.items()}
    print("\nmedian over rounds of the per-run median step time (wall / process CPU), and vs plain:")
    for kind, (wall, cpu) in med.items():
        print(
            f"  {kind:8s} {wall:7.1f} / {cpu:7.1f} ms  "
            f"{wall / med['plain'][0]:5.3f}x / {cpu / med['plain'][1]:5.3f}x"
        )
    if not args.no_attribute:
        timer = CallTimer()
        harness.fit(args.warmup, "default", timer)
        measured = args.steps - args.warmup
        print(f"\nprofiled default run: ms per step in each callback's per-step hooks ({measured} steps)")
        costs = hook_costs(harness.profile, args.warmup, args.steps)
        for name, seconds in sorted(costs.items(), key=lambda kv: -kv[1]):
            print(f"  {name:24s} {1000 * seconds:7.3f}")
        print(f"  {'all callbacks':24s} {1000 * sum(costs.values()):7.3f}")
        for name, seconds in timer.seconds.items():
            print(f"  {name:32s} {1000 * seconds / measured:7.3f} ms/step ({timer.calls[name]} calls)")
    (pw, pc), (bw, bc), (dw, dc) = med["plain"], med["bare"], med["default"]
    print(
        f"RESULT lightning_overhead ratio={dc / pc:.3f} (median CPU ms/step: default callbacks {dc:.1f}, plain "
        f"loop {pc:.1f}, bare Trainer {bc:.1f} ({bc / pc:.3f}x); wall {dw:.1f} / {pw:.1f} / {bw:.1f} "
        f"({dw / pw:.3f}x); demo model, {args.steps} steps ({args.warmup} warm-up) x {args.rounds} interleaved "
        f"rounds, {args.threads} thread(s))"
    )


if __name__ == "__main__":
    main()
