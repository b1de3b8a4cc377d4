"""Time-to-target of the demo: ``python -m mm_lightning fit --config configs/demo.yaml`` from a cold cache.

Runs the real command in a subprocess (data generation included: a fresh data directory), then reads the run's
TensorBoard events and reports when ``val/r1_t2i`` first reached the target, measured from the command's start.

    python benchmarks/demo_fit.py                 # target 0.9 within 180 s
    python benchmarks/demo_fit.py --budget 240 -- --trainer.max_epochs 20   # extra args go to the CLI
    python benchmarks/demo_fit.py --quick         # checks that it runs: 4 small steps, 2 validations

Last line: ``RESULT demo_fit ratio=<time_to_target / budget> (...)``; ratio <= 1 meets the target.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.small_demo import SMALL_DEMO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
# --quick: 4 small batches of the small demo, validated after 2 and 4
QUICK = [
    *SMALL_DEMO,
    "--trainer.max_steps", "4",
    "--trainer.max_epochs", "1",
    "--trainer.val_check_interval", "2",
    "--data.init_args.num_workers", "0",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--budget", type=float, default=180.0, help="seconds allowed for the whole command")
    parser.add_argument("--quick", action="store_true", help="4 small steps, validated after 2 and 4")
    parser.add_argument("cli_args", nargs="*", help="extra CLI overrides (after --)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        command = [
            sys.executable, "-m", "mm_lightning", "fit", "--config", str(REPO / "configs" / "demo.yaml"),
            "--data.init_args.data_dir", str(root / "demo"),
            "--trainer.default_root_dir", str(root / "logs" / "demo"),  # logs in version_N/, checkpoints/
            "--trainer.enable_progress_bar", "false",
            *(QUICK if args.quick else []),
            *args.cli_args,
        ]  # fmt: skip
        start = time.time()
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        total = time.time() - start
        (log_dir,) = (root / "logs").glob("*/version_*")
        events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
        events.Reload()
        series = events.Scalars("val/r1_t2i")

    for event in series:
        print(f"step {event.step:5d}  t={event.wall_time - start:6.1f}s  val/r1_t2i={event.value:.3f}")
    reached = next((e for e in series if e.value >= args.target), None)
    best = max(e.value for e in series)
    if reached is None:
        print(f"RESULT demo_fit ratio=inf (val/r1_t2i never reached {args.target}; best {best:.3f}; "
              f"command took {total:.1f}s)")  # fmt: skip
        return
    to_target = reached.wall_time - start
    print(
        f"RESULT demo_fit ratio={to_target / args.budget:.3f} (val/r1_t2i>={args.target} after {to_target:.1f}s at "
        f"step {reached.step}; budget {args.budget:.0f}s; whole command {total:.1f}s; best {best:.3f})"
    )


if __name__ == "__main__":
    main()
