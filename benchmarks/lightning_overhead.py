"""Per-step cost of Lightning and of the CLI's default callbacks on the demo model, vs a plain PyTorch loop.

    python benchmarks/lightning_overhead.py [--steps 30] [--warmup 5] [--rounds 3] [--threads 1]
    python benchmarks/lightning_overhead.py --quick   # checks that it runs: 4 small steps, 1 round, a temp folder

Same model (``configs/demo.yaml``, same initial weights), same optimizer and LR schedule (the module's own
``configure_optimizers``), same in-memory batches (taken once from the demo datamodule, already normalized),
fp32, one epoch, no validation, the same ``torch.set_num_threads`` everywhere, the model in train mode. Runs:

  plain:   ``training_step`` -> ``zero_grad`` -> ``backward`` (the module's, which closes its one-time FLOPs
           count exactly as under the Trainer) -> the module's per-tower clipping (``clip_towers_and_heads``, what its
           ``configure_gradient_clipping`` runs) -> ``optimizer.step`` -> ``scheduler.step``, in a for loop;
  bare:    ``Trainer.fit`` with no logger, no callbacks, no progress bar (Lightning itself + the module's hooks);
  default: ``Trainer.fit`` with the trainer the CLI builds from ``configs/demo.yaml`` (TensorBoard logger, rich
           progress bar and every default callback (mm_lightning/callbacks/default.yaml).

A step is the interval between two consecutive batch starts, so every per-step hook and periodic cost
(TensorBoard writes every ``log_every_n_steps``, ...) is inside it; the last batch's interval, which would
contain the end of ``fit`` (epoch-end checkpoint, teardown), and the first ``--warmup`` steps are not measured.
On a shared machine the step time itself swings by 10-20 % between runs with the load of other processes, more
than the overhead being measured; so each step's interval is divided by the time spent *in the same step* in
the model's own work (what the plain loop does; :class:`WorkMeter`), which load stretches alike. A run's figure
is the median of that ratio over its steps; runs alternate in ``--rounds`` rounds and each kind's figure is the
median over rounds; the result is default's figure divided by plain's (plain's own ratio, ~1.002, is the loop
and timer cost). Median step wall times are printed too.

Attribution: one more default run under Lightning's ``SimpleProfiler`` gives the time of every callback hook per
step (the callbacks' own code, nothing else), plus the TensorBoard logger's ``log_metrics`` and the module's
``self.log`` calls, timed by wrapping them. Last line: ``RESULT lightning_overhead ratio=<default/plain>``;
target <= 1.02.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import SimpleProfiler
from support.small_demo import SMALL_DEMO
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mm_lightning.cli import cli_main  # noqa: E402
from mm_lightning.models.optim import clip_towers_and_heads  # noqa: E402

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
QUICK = SMALL_DEMO  # --quick


class WorkMeter:
    """Per step: the wall time between batch starts and the time spent in the model's own work.

    The work is what the plain loop also does: the module's ``training_step`` (minus its ``self.log`` calls),
    ``backward``, gradient clipping, the optimizer's update (its ``step`` minus the closure Lightning passes, which
    runs ``training_step`` and ``backward``) and ``zero_grad``. Their ratio per step,
    ``interval / work``, cancels what load from other processes does to both; its median over steps is the
    run's figure.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.intervals: list[float] = []
        self.works: list[float] = []
        self._last: float | None = None
        self._work = 0.0
        self._depth = 0  # > 0 inside a work section (nested sections are counted once)

    def batch_start(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.intervals.append(now - self._last)
            self.works.append(self._work)
        self._last, self._work = now, 0.0

    def work(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Counts ``fn``'s time as model work."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._work += time.perf_counter() - start
                self._depth -= 1

        return timed

    def not_work(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Removes ``fn``'s time from the work section it is called in (e.g. ``self.log``)."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._depth:
                    self._work -= time.perf_counter() - start

        return timed

    def optimizer_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The optimizer's ``step``: work, except the closure's own (already counted) sections."""

        @functools.wraps(fn)
        def timed(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            if closure is None:
                return self.work(fn)(**kwargs)
            inside = 0.0

            def timed_closure() -> Any:
                nonlocal inside
                start = time.perf_counter()
                try:
                    return closure()
                finally:
                    inside += time.perf_counter() - start

            start = time.perf_counter()
            try:
                return fn(closure=timed_closure, **kwargs)
            finally:
                self._work += time.perf_counter() - start - inside

        return timed

    def instrument_model(self, model: pl.LightningModule) -> None:
        model.training_step = self.work(model.training_step)
        model.backward = self.work(model.backward)
        model.configure_gradient_clipping = self.work(model.configure_gradient_clipping)
        model.log = self.not_work(model.log)

    def instrument_optim(self, optimizer: torch.optim.Optimizer) -> None:
        # (the scheduler's step, ~0.1 ms, stays outside: wrapping it would end up in its checkpointed state)
        optimizer.step = self.optimizer_step(optimizer.step)
        optimizer.zero_grad = self.work(optimizer.zero_grad)

    def summary(self) -> tuple[float, float]:
        """Median step wall time (s) and median ``interval / work`` over the measured steps."""
        pairs = list(zip(self.intervals, self.works, strict=True))[self.warmup :]
        return statistics.median(i for i, _ in pairs), statistics.median(i / w for i, w in pairs)


class StepClock(pl.Callback):
    """Feeds the meter's batch starts (put first so it sees the whole step) and instruments the optimizer."""

    def __init__(self, meter: WorkMeter) -> None:
        self.meter = meter

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.instrument_optim(trainer.optimizers[0])

    def on_train_batch_start(self, *args: object) -> None:
        self.meter.batch_start()


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

    def __init__(self, steps: int, root: Path, options: Sequence[str] = ()) -> None:
        self.steps, self.root, self.options = steps, root, list(options)  # options: more CLI arguments
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
            *self.options,
        ]  # fmt: skip
        return cli_main(args, run=False)

    def model(self, cli: Any | None = None) -> pl.LightningModule:
        model = (cli or self.cli()).model
        model.load_state_dict(self.initial)
        return model

    def loader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, shuffle=False)

    def plain(self, warmup: int) -> tuple[float, float]:
        cli = self.cli()
        model = self.model(cli)
        # The module's own optimizer and schedule, with the trainer the CLI built attached as a fit attaches it.
        # Before a fit that trainer has no train loader, so the run's length it gives the schedule is max_steps,
        # which is the fit runs' length too (their loader holds that many batches).
        assert cli.trainer.estimated_stepping_batches == self.batches_per_run, "the fit runs' schedule length"
        model.trainer = cli.trainer
        config = model.configure_optimizers()
        model.trainer = None  # training_step then runs as in any plain loop
        optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
        meter = WorkMeter(warmup)
        meter.instrument_model(model)
        meter.instrument_optim(optimizer)

        @meter.work
        def clip() -> None:
            # what the module's configure_gradient_clipping does (nothing with the demo config)
            clip_towers_and_heads(
                model,
                {
                    "image_encoder": (model.model.image_encoder, model.image_config.clip_norm),
                    "text_encoder": (model.model.text_encoder, model.text_config.clip_norm),
                },
                model.optim_config.clip_heads,
            )

        model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a trainer warns and does nothing
            for i, batch in enumerate(self.batches):
                meter.batch_start()
                loss = model.training_step(batch, i)
                optimizer.zero_grad(set_to_none=True)
                model.backward(loss)
                clip()
                optimizer.step()
                scheduler.step()
        return meter.summary()

    def fit(self, warmup: int, kind: str, timer: CallTimer | None = None) -> tuple[float, float]:
        """``kind``: "bare" or "default"; with ``timer``, the default run is profiled hook by hook."""
        meter = WorkMeter(warmup)
        clock = StepClock(meter)
        cli = self.cli()
        model = self.model(cli)
        meter.instrument_model(model)
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
            batch_start = meter.batch_start

            def start_and_activate() -> None:
                batch_start()
                timer.active = len(meter.intervals) >= warmup

            meter.batch_start = start_and_activate
        trainer.fit(model, train_dataloaders=self.loader())
        if timer is not None:
            self.profile = trainer.profiler.recorded_durations
        return meter.summary()


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


@contextlib.contextmanager
def data_folder(given: Path | None, quick: bool, name: str) -> Iterator[Path]:
    """``given``; else with ``quick`` a fresh temporary folder; else ``name`` in the temp folder, where the generated
    data stays for the next run."""
    if given is None and quick:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)
    else:
        yield given or Path(tempfile.gettempdir()) / name


def quiet_process(threads: int) -> None:
    """The benchmark process: ``threads`` torch threads, no tokenizer threads, no warnings or Lightning notices."""
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def print_attribution(harness: Harness, warmup: int, steps: int) -> None:
    """One more default run, profiled: ms per step in each callback's per-step hooks, ``self.log``, the logger."""
    timer = CallTimer()
    harness.fit(warmup, "default", timer)
    measured = steps - warmup
    print(f"\nprofiled default run: ms per step in each callback's per-step hooks ({measured} steps)")
    costs = hook_costs(harness.profile, warmup, steps)
    for name, seconds in sorted(costs.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {1000 * seconds:7.3f}")
    print(f"  {'all callbacks':24s} {1000 * sum(costs.values()):7.3f}")
    for name, seconds in timer.seconds.items():
        print(f"  {name:32s} {1000 * seconds / measured:7.3f} ms/step ({timer.calls[name]} calls)")


def report(args: argparse.Namespace, harness: Harness) -> None:
    """The runs, their medians over rounds, the attribution and the RESULT line."""
    print(f"default callbacks: {', '.join(harness.callback_names)}", flush=True)
    kinds = ["plain", "bare", "default"]
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in range(args.rounds):
        for kind in kinds:
            wall, ratio = harness.plain(args.warmup) if kind == "plain" else harness.fit(args.warmup, kind)
            runs[kind].append((wall, ratio))
            print(
                f"round {r} {kind:8s} step {1000 * wall:7.1f} ms  step / model work {ratio:6.3f}", flush=True
            )
    wall = {k: 1000 * statistics.median(w for w, _ in v) for k, v in runs.items()}
    ratio = {k: statistics.median(x for _, x in v) for k, v in runs.items()}
    vs_plain = {k: ratio[k] / ratio["plain"] for k in kinds}
    print("\nmedian over rounds: step wall time, step / model work, and that ratio vs plain's:")
    for kind in kinds:
        print(f"  {kind:8s} {wall[kind]:7.1f} ms  {ratio[kind]:6.3f}  {vs_plain[kind]:6.3f}x")
    if not args.no_attribute:
        print_attribution(harness, args.warmup, args.steps)
    print(
        f"RESULT lightning_overhead ratio={vs_plain['default']:.3f} (step / model work: default callbacks "
        f"{ratio['default']:.3f}, bare Trainer {ratio['bare']:.3f} ({vs_plain['bare']:.3f}x), plain loop "
        f"{ratio['plain']:.3f}; median step {wall['default']:.1f} / {wall['bare']:.1f} / {wall['plain']:.1f} ms; "
        f"demo model, {args.steps} steps ({args.warmup} warm-up) x {args.rounds} interleaved rounds, "
        f"{args.threads} thread(s))"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="measured batches per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-attribute", action="store_true", help="skip the profiled run")
    parser.add_argument(
        "--data", type=Path, help="data and run folder (default: mm_lightning_overhead in the temp folder)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="4 small steps, 1 round, in a fresh temporary folder"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = 4, 1, 1
    quiet_process(args.threads)
    with data_folder(args.data, args.quick, "mm_lightning_overhead") as data:
        report(args, Harness(args.steps, data, QUICK if args.quick else ()))


if __name__ == "__main__":
    main()
