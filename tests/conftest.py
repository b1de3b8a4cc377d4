"""Shared fixtures: one tiny real training run through the CLI, reused by the CLI and TensorBoard tests."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# In pytest-xdist's workers (pyproject's addopts) torch gets one thread, as do the processes tests start (they
# inherit it): two workers with a thread per core each would oversubscribe the cores.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
DEFAULT_CALLBACKS = REPO / "mm_lightning" / "callbacks" / "default.yaml"  # every run's
LONG_RUN_CALLBACKS = (
    REPO / "configs" / "callbacks" / "long_run.yaml"
)  # what every recipe's but the demo's adds


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: the CPUs this process may run on (a container's share, not the host's cores)."""
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ or not hasattr(os, "sched_getaffinity"):
        return None  # xdist's own count
    return len(os.sched_getaffinity(0))


CHECKPOINT_GROUPS = ("best_checkpoint", "checkpoint", "timed_checkpoint")


def default_callback_entries() -> list[dict]:
    """The default ``trainer.callbacks`` list, then the long-run callbacks (the NaN guard, preemption saves and
    exact resume)."""
    import yaml

    return yaml.safe_load(DEFAULT_CALLBACKS.read_text()) + yaml.safe_load(LONG_RUN_CALLBACKS.read_text())


def callback_args(root: Path, **changes: dict | None) -> list[str]:
    """The long-run callbacks, tuned the way a user tunes them: ``changes`` keyed by a checkpoint group
    (``checkpoint``, ``timed_checkpoint``, ``best_checkpoint``) become its options on the command line
    (``--checkpoint.every_n_train_steps 2``); keyed by class name, new init_args of a list entry, or None to
    drop it, in a copy of the list written under ``root`` (``--trainer.callbacks <file>``)."""
    import yaml

    entries = default_callback_entries()
    listed = {k: v for k, v in changes.items() if k not in CHECKPOINT_GROUPS}
    unknown = set(listed) - {e["class_path"].rpartition(".")[2] for e in entries}
    assert not unknown, unknown
    kept = []
    for entry in entries:
        change = listed.get(entry["class_path"].rpartition(".")[2], {})
        if change is not None:
            kept.append({**entry, "init_args": {**(entry.get("init_args") or {}), **change}})
    text = yaml.safe_dump(kept, sort_keys=False)
    path = Path(root) / f"callbacks-{hashlib.sha256(text.encode()).hexdigest()[:8]}.yaml"  # one per variant
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    options = [
        f"--{group}.{key}={value if isinstance(value, str) else json.dumps(value)}"
        for group in CHECKPOINT_GROUPS
        for key, value in (changes.get(group) or {}).items()
    ]
    return ["--trainer.callbacks", str(path), *options]


def small_demo_args(root: Path) -> list[str]:
    """The demo config with its data under ``root``, rendered small (32 px, 24 validation and test images)."""
    return [
        "--config", str(DEMO_CONFIG),
        "--data.init_args.data_dir", str(root / "demo"),
        "--data.init_args.render_size", "32",
        "--model.image_tower.init_args.image_size", "32",
        "--data.init_args.train_renders", "1",
        "--data.init_args.num_val", "24",
        "--data.init_args.num_test", "24",
        "--data.init_args.batch_size", "16",
    ]  # fmt: skip


def tiny_demo_args(
    root: Path, *extra: str, max_steps: int = 6, callbacks: dict[str, dict | None] | None = None
) -> list[str]:
    """CLI arguments for a seconds-long demo run whose files all live under ``root``, with the long-run callbacks
    (``callbacks`` tunes them, see :func:`callback_args`)."""
    return [
        *small_demo_args(root),
        "--data.init_args.num_workers", "0",
        "--trainer.max_steps", str(max_steps),
        "--trainer.max_epochs", "1",
        "--trainer.val_check_interval", "3",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),  # logs in root/version_N, checkpoints in root/checkpoints
        *callback_args(root, **{"ThroughputLogger": {"window_size": 3}, **(callbacks or {})}),
        *extra,
    ]  # fmt: skip


@pytest.fixture(autouse=True)
def _isolated_environment() -> Iterator[None]:
    """Undo environment and thread-count changes a test leaves behind.

    In-process Lightning runs (``ddp_spawn``, ``seed_everything``) write MASTER_PORT, PL_GLOBAL_SEED, ... into
    ``os.environ``; later subprocess launches would inherit them (e.g. every 2-process CLI run reusing one port).
    """
    import torch

    saved, threads = dict(os.environ), torch.get_num_threads()
    yield
    os.environ.clear()
    os.environ.update(saved)
    torch.set_num_threads(threads)  # runs compared with one another in this process use the same thread count


@dataclass
class TinyRun:
    root: Path
    log_dir: Path
    checkpoint_dir: Path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    """A real ``fit`` of the demo config, shrunk to a few steps, with its logs and checkpoints."""
    from mm_lightning.cli import cli_main

    root = tmp_path_factory.mktemp("tiny_run")
    monitors = [
        "StepTimeMonitor",
        "PeakMemoryMonitor",
        "GradNormMonitor",
        "FlopCounter",
        "RetrievalGridLogger",
    ]
    opt_in = [f"--trainer.callbacks+=mm_lightning.extras.{name}" for name in monitors]
    cli = cli_main(["fit", *tiny_demo_args(root), *opt_in])
    return TinyRun(root=root, log_dir=Path(cli.trainer.logger.log_dir), checkpoint_dir=root / "checkpoints")
