"""Resume from a ``last.ckpt`` written at an epoch's end: the next epoch trains in full and the run ends
bit-equal to an uninterrupted one (1 and 2 processes, 0 and 2 loader workers, JSONL and shards).

Lightning ends an epoch after ``len(loader)`` batches without asking the loader for one more; a plain
``StatefulDataLoader``'s state saved there makes the next epoch empty (the control below), which the train
loader's own position (samples consumed) does not."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from mm_lightning.cli import cli_main, main
from mm_lightning.data.demo import demo_generator_args, generate_demo_dataset
from mm_lightning.data.order import GlobalOrderSampler
from mm_lightning.data.resume import ResumableDataLoader, ResumeError
from tests.conftest import DEMO_CONFIG
from tests.test_process_exit import exit_problems, run_or_report_hang

BATCHES = 6  # per epoch and rank: 24 samples, batch 4


def make_loader(cls: type, workers: int, persistent: bool, distributed: bool) -> StatefulDataLoader:
    data = list(range(24 * (2 if distributed else 1)))
    kwargs = {"persistent_workers": persistent} if workers else {}
    world, rank = (2, 1) if distributed else (1, 0)
    sampler = GlobalOrderSampler(len(data), 4, num_replicas=world, rank=rank, seed=3)
    return cls(data, batch_size=4, sampler=sampler, num_workers=workers, drop_last=True, **kwargs)


def run_epoch(
    loader: StatefulDataLoader, epoch: int, start: int = 0, resumed: bool = False
) -> list[list[int]]:
    """What Lightning does: set the sampler's epoch, then take exactly the epoch's remaining batches by count.

    In the first epoch of a resumed run Lightning creates the iterator before it sets the sampler's epoch.
    """
    batches = iter(loader) if resumed else None
    loader.sampler.set_epoch(epoch)
    batches = batches or iter(loader)
    return [next(batches, torch.tensor([-1])).tolist() for _ in range(BATCHES - start)]


def resumed(cls: type, state: dict, *settings: object) -> StatefulDataLoader:
    loader = make_loader(cls, *settings)
    loader.load_state_dict(state)
    return loader


@pytest.mark.parametrize("distributed", [False, True], ids=["one_process", "rank_1_of_2"])
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_loader_state_at_epoch_end_resumes_at_the_next_epoch(
    workers: int, persistent: bool, distributed: bool
) -> None:
    settings = (workers, persistent, distributed)
    loader = make_loader(ResumableDataLoader, *settings)
    uninterrupted = [run_epoch(loader, epoch) for epoch in range(3)]

    loader = make_loader(ResumableDataLoader, *settings)
    run_epoch(loader, 0)
    after_epoch_end = resumed(ResumableDataLoader, loader.state_dict(), *settings)
    assert [run_epoch(after_epoch_end, 1, resumed=True), run_epoch(after_epoch_end, 2)] == uninterrupted[1:]

    # Resumed mid-epoch, run to that epoch's end, saved and resumed again.
    loader = make_loader(ResumableDataLoader, *settings)
    run_epoch(loader, 0)
    loader.sampler.set_epoch(1)
    batches = iter(loader)
    assert [next(batches).tolist() for _ in range(2)] == uninterrupted[1][:2]
    mid_epoch = resumed(ResumableDataLoader, loader.state_dict(), *settings)
    assert run_epoch(mid_epoch, 1, start=2, resumed=True) == uninterrupted[1][2:]
    again = resumed(ResumableDataLoader, mid_epoch.state_dict(), *settings)
    assert run_epoch(again, 2, resumed=True) == uninterrupted[2]

    # Control: torchdata's own loader, resumed from the epoch-end state, yields an empty epoch.
    loader = make_loader(StatefulDataLoader, *settings)
    run_epoch(loader, 0)
    stock_state = loader.state_dict()
    stock = resumed(StatefulDataLoader, stock_state, *settings)
    assert run_epoch(stock, 1, resumed=True) == [[-1]] * BATCHES

    # That state (a batch count per process, no position of the epoch) is refused, not guessed at.
    with pytest.raises(ResumeError, match="where the epoch stopped is unknown"):
        resumed(ResumableDataLoader, stock_state, *settings)


def keep_epoch_end(to: Path) -> list[str]:
    """Options that copy the run's end-of-first-epoch ``last.ckpt`` into the run folder ``to``."""
    keep = {"class_path": "tests.resilience.helpers.KeepEpochEndCheckpoint", "init_args": {"to": str(to)}}
    return ["--trainer.callbacks+", json.dumps(keep)]


STEPS = 8  # per epoch on one process: 128 images, batch 16


@pytest.fixture(scope="module")
def user_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's data, small: 128 training and 24 validation records of the generated demo as JSONL, and the
    same converted to shards (``shards/<split>/shards.json``)."""
    root = tmp_path_factory.mktemp("epoch_end_resume")
    generate_demo_dataset(root / "demo", **demo_generator_args(32, 1, 24, 24, 0))
    (root / "images").symlink_to(root / "demo" / "images")
    for split, rows in (("train", 128), ("val", 24)):
        lines = (root / "demo" / f"{split}.jsonl").read_text().splitlines(keepends=True)[:rows]
        (root / f"{split}.jsonl").write_text("".join(lines))
    assert (
        main(
            [
                "shard",
                *run_args(root, root / "unused", 0),
                "--out",
                str(root / "shards"),
                "--progress",
                "false",
            ]
        )
        == 0
    )
    return root


def run_args(data: Path, run: Path, workers: int, shards: bool = False) -> list[str]:
    """Two epochs on ``data`` with the demo's tiny towers, validation at epoch ends, deterministic."""
    if shards:
        files = {
            f"{split}_shards": str(data / "shards" / split / "shards.json") for split in ("train", "val")
        }
        data_class = "mm_lightning.extras.ShardDataModule"
    else:
        files = {f"{split}_file": str(data / f"{split}.jsonl") for split in ("train", "val")}
        data_class = "mm_lightning.data.MultimodalDataModule"
    init_args = {**files, "batch_size": 16, "num_workers": workers}
    return [
        "--config", str(DEMO_CONFIG),
        "--data", json.dumps({"class_path": data_class, "init_args": init_args}),
        "--model.image_tower.init_args.image_size", "32",
        "--trainer.max_epochs", "2",
        "--trainer.val_check_interval", "1.0",
        "--trainer.deterministic", "true",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run),
    ]  # fmt: skip


def last_checkpoint(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def assert_bit_equal(resumed: dict, uninterrupted: dict) -> None:
    assert resumed["global_step"] == uninterrupted["global_step"]
    assert resumed["state_dict"].keys() == uninterrupted["state_dict"].keys()
    for name, value in uninterrupted["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workers", "shards"), [(0, False), (2, False), (0, True)], ids=["jsonl", "jsonl_2_workers", "shards"]
)
def test_epoch_end_resume_trains_the_next_epoch_and_ends_bit_equal(
    tmp_path: Path, user_data: Path, workers: int, shards: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = user_data
    stopped, control = tmp_path / "stopped", tmp_path / "control"
    cli_main(["fit", *run_args(data, tmp_path / "full", workers, shards), *keep_epoch_end(stopped)])
    uninterrupted = last_checkpoint(tmp_path / "full")
    assert uninterrupted["global_step"] == 2 * STEPS
    at_epoch_end = last_checkpoint(stopped)
    assert (at_epoch_end["epoch"], at_epoch_end["global_step"]) == (0, STEPS)
    shutil.copytree(stopped, control)

    cli_main(["fit", *run_args(data, stopped, workers, shards), "--ckpt_path", "last"])
    assert_bit_equal(last_checkpoint(stopped), uninterrupted)

    if workers == 0 and not shards:
        # Control: a resume whose second epoch reads the first epoch's order ends elsewhere, and the check sees it.
        monkeypatch.setattr(GlobalOrderSampler, "set_epoch", lambda self, epoch: None)
        cli_main(["fit", *run_args(data, control, workers, shards), "--ckpt_path", "last"])
        assert last_checkpoint(control)["global_step"] == 2 * STEPS
        with pytest.raises(AssertionError):
            assert_bit_equal(last_checkpoint(control), uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_epoch_end_resume_on_two_processes_ends_bit_equal(tmp_path: Path, user_data: Path) -> None:
    data = user_data
    two = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]

    def fit(run: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "mm_lightning", "fit", *run_args(data, run, 2), *two, *extra]
        result = run_or_report_hang(cmd, timeout=300)
        output = result.stdout
        # What a user runs on 2 processes also ends cleanly each time (a gloo race at exit once aborted 1 run in 3;
        # test_process_exit.py repeats its trigger more often and more cheaply).
        assert exit_problems(result.returncode, output) == [], output[-5000:]

    fit(tmp_path / "full", *keep_epoch_end(tmp_path / "stopped"))
    uninterrupted = last_checkpoint(tmp_path / "full")
    assert uninterrupted["global_step"] == STEPS  # half the steps per epoch on each of 2 ranks
    assert last_checkpoint(tmp_path / "stopped")["global_step"] == STEPS // 2
    fit(tmp_path / "stopped", "--ckpt_path", "last")
    assert_bit_equal(last_checkpoint(tmp_path / "stopped"), uninterrupted)
