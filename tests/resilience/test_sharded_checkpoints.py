"""A sharded checkpoint (a DCP folder + Lightning's ``meta.pt``) is data: a folder whose index, non-tensor entry or
``meta.pt`` names a function is refused in one line naming the file, and nothing runs; torch's own reader runs
the same folder's payload (the control). A clean folder loads whole in one process and into a model and
optimizer in place."""

from __future__ import annotations

import pickle
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from mm_lightning.checkpoints.files import sha256_of
from mm_lightning.checkpoints.sharded import (
    METADATA_FILE,
    ShardedCheckpointError,
    is_sharded_checkpoint,
    load_sharded,
    read_metadata,
    read_sharded_checkpoint,
)
from tests.resilience.hostile_payload import leave_marker

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Pickles as a call of ``leave_marker``: stands for any command."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return leave_marker, ()


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ran"
    monkeypatch.setenv("HOSTILE_MARKER", str(path))
    return path


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def write_checkpoint(
    folder: Path, extra: dict[str, Any] | None = None, meta: dict[str, Any] | None = None
) -> nn.Module:
    """A folder as Lightning's ModelParallelStrategy writes it, from one process."""
    model, optimizer = trained()
    state = {"state_dict": model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    dcp.save({**state, **(extra or {})}, checkpoint_id=folder, no_dist=True)
    torch.save(
        meta or {"pytorch-lightning_version": "2.6.6", "epoch": 1, "hyper_parameters": {}}, folder / "meta.pt"
    )
    return model


def test_a_clean_folder_loads_whole_and_in_place(tmp_path: Path) -> None:
    folder = tmp_path / "last.ckpt"
    saved = write_checkpoint(folder)
    assert is_sharded_checkpoint(folder)
    whole = read_sharded_checkpoint(folder)
    assert whole["epoch"] == 1
    assert set(whole["state_dict"]) == set(saved.state_dict())
    for key, value in saved.state_dict().items():
        assert torch.equal(whole["state_dict"][key], value)

    model, optimizer = trained(seed=1)  # other weights and moments, to be replaced
    state = {"state_dict": model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    load_sharded(state, folder)
    model.load_state_dict(state["state_dict"])
    set_optimizer_state_dict(model, optimizer, state["optimizer_0"])
    for key, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    reference, reference_optimizer = trained()
    loaded, expected = optimizer.state_dict(), reference_optimizer.state_dict()
    assert loaded["param_groups"][0]["lr"] == expected["param_groups"][0]["lr"]
    for index, moments in expected["state"].items():
        assert torch.equal(loaded["state"][index]["exp_avg_sq"], moments["exp_avg_sq"])


def test_an_index_naming_a_function_is_refused_and_torch_runs_it(tmp_path: Path, marker: Path) -> None:
    folder = tmp_path / "last.ckpt"
    write_checkpoint(folder)
    (folder / METADATA_FILE).write_bytes(pickle.dumps(Payload()))
    with pytest.raises(
        ShardedCheckpointError, match=r"\.metadata refers to tests\.resilience\.hostile_payload"
    ):
        read_sharded_checkpoint(folder)
    with pytest.raises(ShardedCheckpointError, match="could run code"):
        load_sharded({"state_dict": trained()[0].state_dict()}, folder)
    assert not marker.exists()
    with suppress(AttributeError):  # control: torch's own reader calls it (then reads its None)
        FileSystemReader(folder).read_metadata()
    assert marker.exists()


def test_an_entry_naming_a_function_is_refused_and_torch_runs_it(tmp_path: Path, marker: Path) -> None:
    folder = tmp_path / "last.ckpt"
    write_checkpoint(folder, extra={"notes": Payload()})
    model = trained()[0]
    with pytest.raises(ShardedCheckpointError, match=r"entry 'notes' cannot be loaded as data"):
        load_sharded({"state_dict": model.state_dict(), "notes": None}, folder)
    assert not marker.exists()
    dcp.load(
        {"notes": None}, storage_reader=FileSystemReader(folder), planner=DefaultLoadPlanner(), no_dist=True
    )
    assert marker.exists()  # control: torch's own planner calls it


def test_a_meta_file_naming_a_function_is_refused(tmp_path: Path, marker: Path) -> None:
    folder = tmp_path / "last.ckpt"
    write_checkpoint(folder, meta={"pytorch-lightning_version": "2.6.6", "callbacks": Payload()})
    with pytest.raises(ShardedCheckpointError, match=r"meta\.pt cannot be loaded as data"):
        read_sharded_checkpoint(folder)
    assert not marker.exists()
    torch.load(folder / "meta.pt", weights_only=False)  # control
    assert marker.exists()


def test_foreign_files_and_entries_pointing_outside_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "last.ckpt"
    write_checkpoint(folder)
    (folder / "run.py").write_text("print('hello')\n")
    with pytest.raises(ShardedCheckpointError, match=r"holds \['run.py'\]"):
        read_metadata(folder)
    (folder / "run.py").unlink()

    metadata = read_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../secret.distcp"
    (folder / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(ShardedCheckpointError, match="not a shard file"):
        read_metadata(folder)


def test_an_interrupted_save_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "last.ckpt"
    write_checkpoint(folder)
    (folder / "meta.pt").unlink()
    with pytest.raises(ShardedCheckpointError, match=r"lacks meta\.pt: the save was interrupted"):
        read_sharded_checkpoint(folder)


def test_the_digest_covers_every_file(tmp_path: Path) -> None:
    folder = tmp_path / "last.ckpt"
    write_checkpoint(folder)
    before = sha256_of(folder)
    assert sha256_of(folder) == before
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert sha256_of(folder) != before


def test_an_interrupted_save_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mm_lightning.extras import ShardedDataParallel, sharded_training

    strategy = ShardedDataParallel()  # one process, no group: its collectives are no-ops
    target = tmp_path / "last.ckpt"

    def checkpoint(step: int) -> dict[str, Any]:
        model = trained(seed=step)[0]
        return {"pytorch-lightning_version": "2.6.6", "global_step": step, "state_dict": model.state_dict()}

    strategy.save_checkpoint(checkpoint(1), target)
    assert read_sharded_checkpoint(target)["global_step"] == 1

    def dies_midway(state: dict[str, Any], checkpoint_id: Path) -> None:
        checkpoint_id.mkdir()
        (checkpoint_id / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(sharded_training.dcp, "save", dies_midway)
    with pytest.raises(OSError, match="disk full"):
        strategy.save_checkpoint(checkpoint(2), target)
    assert read_sharded_checkpoint(target)["global_step"] == 1  # the previous one, whole
    monkeypatch.undo()

    strategy.save_checkpoint(checkpoint(3), target)  # the next save clears what the interrupted one left
    assert read_sharded_checkpoint(target)["global_step"] == 3
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]


def test_links_and_other_non_files_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "last.ckpt"
    write_checkpoint(folder)
    shard = next(folder.glob("*.distcp"))
    outside = tmp_path / "elsewhere.distcp"
    shard.rename(outside)
    shard.symlink_to(outside)  # every entry still resolves, but to a file outside the folder
    with pytest.raises(ShardedCheckpointError, match=r"which are not plain files"):
        read_sharded_checkpoint(folder)
    shard.unlink()
    outside.rename(shard)
    (folder / "__9_0.distcp").mkdir()
    with pytest.raises(ShardedCheckpointError, match=r"\['__9_0.distcp'\], which are not plain files"):
        read_sharded_checkpoint(folder)


def test_a_save_that_dies_between_its_renames_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mm_lightning.checkpoints.files import run_checkpoint
    from mm_lightning.extras import ShardedDataParallel, sharded_training

    strategy = ShardedDataParallel()
    target = tmp_path / "last.ckpt"
    state = trained()[0].state_dict()
    strategy.save_checkpoint(
        {"pytorch-lightning_version": "2.6.6", "global_step": 1, "state_dict": state}, target
    )
    renames = []

    def second_rename_dies(source: Path, destination: Path) -> None:
        renames.append(destination)
        if len(renames) == 2:
            raise KeyboardInterrupt  # the process dies with the previous checkpoint moved aside
        original_replace(source, destination)

    original_replace = sharded_training.os.replace
    monkeypatch.setattr(sharded_training.os, "replace", second_rename_dies)
    with pytest.raises(KeyboardInterrupt):
        strategy.save_checkpoint(
            {"pytorch-lightning_version": "2.6.6", "global_step": 2, "state_dict": state}, target
        )
    monkeypatch.undo()
    assert not target.exists()
    assert run_checkpoint("last", str(tmp_path), fresh_ok=True) == str(
        target
    )  # --ckpt_path last puts it back
    assert read_sharded_checkpoint(target)["global_step"] == 1


def test_a_run_folder_given_as_a_checkpoint_is_named_as_not_one(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    with pytest.raises(
        ShardedCheckpointError, match=r"lacks \.metadata: .* or it is not a sharded checkpoint"
    ):
        read_sharded_checkpoint(tmp_path / "checkpoints")
