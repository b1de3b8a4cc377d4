"""``--ckpt_path last`` / ``best`` never score or export a model they did not load, and a resume that would train
nothing says so: each silent case through the command line, with the working command as its control."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from mm_lightning.cli import cli_main, main
from tests.conftest import TinyRun, tiny_demo_args

SHORT = [
    "--trainer.limit_test_batches",
    "1",
    "--trainer.limit_predict_batches",
    "1",
    "--trainer.limit_val_batches",
    "1",
]


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    return line


@pytest.mark.parametrize("command", ["evaluate", "test", "validate", "predict"])
def test_last_without_a_checkpoint_is_an_error_that_says_where_checkpoints_are(
    tiny_run: TinyRun,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / tiny_run.root.name).symlink_to(tiny_run.root)  # the earlier run sits under logs/
    other_run = tmp_path / "other"  # the config's run folder: no checkpoint in it
    own = ["--output", str(tmp_path / "results")] if command == "evaluate" else []
    writer = {"EmbeddingWriter": {"output_dir": str(tmp_path / "predictions")}}
    args = [command, *own, *tiny_demo_args(other_run, callbacks=writer), *SHORT, "--ckpt_path", "last"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    line = _error_line(capsys)
    assert f"no last checkpoint in {other_run / 'checkpoints'}" in line
    assert f"logs/{tiny_run.root.name}/checkpoints (best-" in line and "last.ckpt" in line
    assert not (tmp_path / "results").exists() and not (tmp_path / "predictions").exists()
    # control: in the run folder that holds last.ckpt the same command loads it
    args[args.index(str(other_run), args.index("--trainer.default_root_dir"))] = str(tiny_run.root)
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    if command == "evaluate":
        (result,) = (tmp_path / "results").glob("*_zeroshot_retrieval.json")
        assert json.loads(result.read_text())["pretrained"] == str(tiny_run.checkpoint_dir / "last.ckpt")
    elif command != "predict":
        assert f"  checkpoint: {tiny_run.checkpoint_dir / 'last.ckpt'}\n" in out


def test_best_is_the_run_folders_best_checkpoint(tiny_run: TinyRun, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run.root, run, symlinks=True)
    # last.ckpt with other weights (the best may be the last step's), so the two files can be told apart
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    last["state_dict"] = {k: v + 1 if v.is_floating_point() else v for k, v in last["state_dict"].items()}
    torch.save(last, run / "checkpoints" / "last.ckpt")
    (best,) = (run / "checkpoints").glob("best*.ckpt")
    cli = cli_main(["test", *tiny_demo_args(run), *SHORT, "--ckpt_path", "best"])
    assert cli.trainer.ckpt_path == str(best)
    # control: the weights scored are that file's, not the last ones
    state = torch.load(best, weights_only=True)["state_dict"]
    loaded = cli.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert not all(torch.equal(loaded[k], v) for k, v in last["state_dict"].items())


def test_export_of_a_name_instead_of_a_file_says_where_checkpoints_are(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / tiny_run.root.name).symlink_to(tiny_run.root)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--ckpt_path", "last", "--out", str(tmp_path / "hf")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--ckpt_path 'last' does not exist; checkpoints are in " in err
        and f"logs/{tiny_run.root.name}" in err
    )
    assert "(pass a checkpoint's path)" in err and "default_root_dir" not in err


def test_fit_last_with_nothing_to_resume_starts_fresh_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    cli = cli_main(["fit", *tiny_demo_args(tmp_path, max_steps=1), *SHORT, "--ckpt_path", "last"])
    assert cli.trainer.global_step == 1
    assert (
        f"--ckpt_path last: no checkpoint in {tmp_path / 'checkpoints'} yet; starting a new run"
        in caplog.text
    )


def test_the_printed_train_further_command_trains_further_and_a_finished_resume_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fit", *tiny_demo_args(tmp_path, max_steps=2), *SHORT]) == 0
    summary = capsys.readouterr().out
    # 2 steps end the run, and its one epoch with them (Lightning counts a stopped epoch as done)
    prefix = "  train further (2 more steps and 1 more epoch): "
    further = next(line for line in summary.splitlines() if line.startswith(prefix))
    command = shlex.split(further.split("python -m mm_lightning ", 1)[1])
    assert command[-4:] == ["--trainer.max_steps", "4", "--trainer.max_epochs", "2"]
    # the same resume without the larger totals would train nothing: said, with the fix, before any log is made
    versions = sorted(p.name for p in tmp_path.glob("version_*"))
    with pytest.raises(SystemExit) as exit_info:
        main(command[:-4])
    assert exit_info.value.code == 2
    line = _error_line(capsys)
    assert "the run already trained 2 steps and 1 epoch, as many as --trainer.max_steps 2 and" in line
    assert "nothing to train" in line and line.endswith("e.g. --trainer.max_steps 4 --trainer.max_epochs 2")
    assert sorted(p.name for p in tmp_path.glob("version_*")) == versions
    # control: the printed command resumes and trains the 2 more steps
    cli = cli_main(command)
    assert cli.trainer.global_step == 4


def test_fit_last_into_a_folder_of_other_checkpoints_is_refused_not_started(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "checkpoints").mkdir()
    (best,) = tiny_run.checkpoint_dir.glob("best*.ckpt")
    shutil.copy(best, tmp_path / "checkpoints" / best.name)  # a best checkpoint, no last.ckpt
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *tiny_demo_args(tmp_path, max_steps=1), "--ckpt_path", "last"])
    assert exit_info.value.code == 2
    assert "already holds an earlier run's checkpoints" in _error_line(capsys)
    assert "starting a new run" not in caplog.text


def test_the_printed_test_and_evaluate_commands_still_run_after_training_further(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a best checkpoint at every validation (the step only grows), so training further replaces the first one
    newest = {"best_checkpoint": {"monitor": "step", "mode": "max"}}
    assert main(["fit", *tiny_demo_args(tmp_path, max_steps=3, callbacks=newest), *SHORT]) == 0
    summary = capsys.readouterr().out.splitlines()
    first_best = next(line for line in summary if line.startswith("  best step: ")).split()[-1]
    printed = {
        name: shlex.split(
            next(line for line in summary if line.startswith(f"  {name}")).split(
                "python -m mm_lightning ", 1
            )[1]
        )
        for name in ("train further", "test it", "evaluate it")
    }
    assert printed["test it"][-2:] == ["--ckpt_path", "best"]
    assert main(printed["train further"]) == 0
    assert not Path(first_best).exists()  # the control: the first run's best file is gone
    assert main(printed["test it"]) == 0
    assert "Finished test: test/r1_t2i " in capsys.readouterr().out
    assert main(printed["evaluate it"]) == 0
    assert list((tmp_path / "version_0" / "evaluation").glob("*_zeroshot_retrieval.json"))
