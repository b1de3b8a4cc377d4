"""Bad checkpoint files fail early and clearly: through ``--ckpt_path`` and through the checkpoint IO plugin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from mm_lightning.checkpoints import AtomicCheckpointIO, CheckpointFileError, check_checkpoint_file
from mm_lightning.cli import cli_main
from tests.conftest import TinyRun, tiny_demo_args
from tests.resilience.helpers import TinyModule, random_loader


def _bad_files(root: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """``{case: (file, expected words in the error)}``."""
    files = {
        "empty": (root / "empty.ckpt", "is empty"),
        "text": (root / "notes.ckpt", "not a PyTorch checkpoint"),
        "truncated": (root / "half.ckpt", "truncated or corrupt"),
        "weights_only_file": (root / "weights.pt", "not a Lightning checkpoint"),
        "tensor": (root / "tensor.pt", "not a Lightning checkpoint"),
        "directory": (root / "folder.ckpt", "is a directory"),
        "missing": (root / "nowhere.ckpt", "does not exist"),
    }
    files["empty"][0].write_bytes(b"")
    files["text"][0].write_text("epoch=3 val/r1=0.9\n")
    data = good.read_bytes()
    files["truncated"][0].write_bytes(data[: len(data) // 2])
    torch.save({"encoder.weight": torch.ones(2)}, files["weights_only_file"][0])
    torch.save(torch.ones(3), files["tensor"][0])
    files["directory"][0].mkdir()
    return files


def test_check_checkpoint_file_names_file_and_problem(tiny_run: TinyRun, tmp_path: Path) -> None:
    good = tiny_run.checkpoint_dir / "last.ckpt"
    assert check_checkpoint_file(good)["global_step"] > 0  # control: a real checkpoint passes
    for case, (path, words) in _bad_files(tmp_path, good).items():
        with pytest.raises(CheckpointFileError) as info:
            check_checkpoint_file(path)
        assert str(path) in str(info.value) and words in str(info.value), case


@pytest.mark.parametrize("case", ["empty", "text", "weights_only_file"])
def test_ckpt_path_to_a_bad_file_is_a_clear_cli_error(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    path, words = _bad_files(tmp_path, tiny_run.checkpoint_dir / "last.ckpt")[case]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *tiny_demo_args(tmp_path / "run"), "--ckpt_path", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and words in err and "Traceback" not in err


def test_ckpt_path_last_resolves_to_the_run_dir_and_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")  # e.g. a copy that ran out of disk
    with pytest.raises(SystemExit):
        cli_main(["fit", *tiny_demo_args(run), "--ckpt_path", "last"])
    assert f"{run / 'checkpoints' / 'last.ckpt'} is empty" in capsys.readouterr().err


def test_plugin_checks_files_loaded_by_the_trainer(tmp_path: Path) -> None:
    bad = tmp_path / "last.ckpt"
    bad.write_text("not a checkpoint")
    trainer = Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[AtomicCheckpointIO()],
    )  # fmt: skip
    with pytest.raises(CheckpointFileError, match="not a PyTorch checkpoint"):
        trainer.fit(TinyModule(), random_loader(16), ckpt_path=bad)
