"""The command line: overrides, linked arguments, clear errors, and fit -> validate/test/predict on real runs."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from mm_lightning.callbacks import ProgressLines
from mm_lightning.cli import cli_main, main
from tests.conftest import REPO, TinyRun, callback_args, tiny_demo_args


def test_overrides_reach_the_objects(tmp_path: Path) -> None:
    groups = ["--data.loader.caption_sampling", "all", "--data.loader.pin_memory", "true"]
    cli = cli_main(
        [*tiny_demo_args(tmp_path), "--model.fusion.heads", "2", "--data.batch_size", "8", *groups], run=False
    )
    # keys of one group given one by one add up, over the group's defaults
    loader = cli.datamodule.hparams.loader
    assert (loader["caption_sampling"], loader["pin_memory"], loader["persistent_workers"]) == (
        "all",
        True,
        True,
    )
    assert cli.model.hparams.fusion["heads"] == 2
    attention = [m for m in cli.model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert attention and all(m.num_heads == 2 for m in attention)
    assert cli.datamodule.hparams.batch_size == 8
    # The tokenizer follows the text encoder (a link); the image size flows from the image tower to the data.
    text, image = cli.model.hparams.text_tower["init_args"], cli.model.hparams.image_tower["init_args"]
    assert cli.datamodule.hparams.tokenizer == text["name"] == "mm-lightning/demo-bert"
    assert image["image_size"] == 32 and cli.datamodule.image_options.size is None
    assert cli.datamodule.image_size == 32  # linked when the CLI built the two


def test_tokenizer_always_follows_the_text_encoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the arguments given replace the process's own (a benchmark's, a command's): no warning that both exist
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--quick"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # jsonargparse applies the link after parsing: a tokenizer set on its own cannot disagree with the encoder
        cli = cli_main(
            [*tiny_demo_args(tmp_path), "--data.init_args.tokenizer", "bert-base-uncased"], run=False
        )
    assert cli.datamodule.hparams.tokenizer == "mm-lightning/demo-bert"
    assert not [w for w in caught if "args parameter" in str(w.message)], [str(w.message) for w in caught]


def test_image_size_flows_from_the_tower_and_a_set_data_size_wins_with_a_warning(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "data.images.size")  # following the tower says nothing
        cli = cli_main(
            [*tiny_demo_args(tmp_path), "--model.image_tower.init_args.image_size", "48"], run=False
        )
    assert cli.datamodule.image_size == 48 == cli.model.data_config["image"]["input_size"][-1]
    assert cli.datamodule.sample_builder("val").transform.size == 48
    # the user's data.images.size wins, and the run says it differs from the tower's
    with pytest.warns(UserWarning, match=r"data.images.size 40 differs from the image tower's input size 32"):
        cli = cli_main([*tiny_demo_args(tmp_path), "--data.init_args.images.size", "40"], run=False)
    # nothing is pushed back into the model
    assert cli.model.hparams.image_tower["init_args"]["image_size"] == 32
    assert cli.datamodule.image_size == 40 and cli.datamodule.sample_builder("val").transform.size == 40


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (["--data.batch_size", "many"], "batch_size"),
        (["--model.text_tower.init_args.pooling", "max"], "pooling"),
        (["--trainer.max_epochs", "1.5"], "max_epochs"),
        (["--model.no_such_option", "1"], "no_such_option"),
    ],
)
def test_bad_values_give_a_clear_parser_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*tiny_demo_args(tmp_path), *override], run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_fit_writes_checkpoints_and_config(tiny_run: TinyRun) -> None:
    assert (tiny_run.checkpoint_dir / "last.ckpt").is_file()
    best = list(tiny_run.checkpoint_dir.glob("best-*.ckpt"))
    assert len(best) == 1, best  # top-1 by val/r1_t2i
    checkpoint = torch.load(best[0], map_location="cpu", weights_only=False)
    monitors = [v["monitor"] for k, v in checkpoint["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert sorted(monitors, key=str) == [None, None, "val/r1_t2i"]  # last.ckpt's two keepers and the best's
    saved = (tiny_run.log_dir / "config.yaml").read_text()
    assert "mm_lightning.data.DemoDataModule" in saved and "heads: 4" in saved


def test_validate_test_predict_from_checkpoint(tiny_run: TinyRun, tmp_path: Path) -> None:
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    args = tiny_demo_args(tiny_run.root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = cli_main(["validate", *args, "--ckpt_path", ckpt])
    assert not [w for w in caught if "Resuming from" in str(w.message)]  # same options: nothing overridden
    assert 0.0 <= float(cli.trainer.callback_metrics["val/r1_t2i"]) <= 1.0
    cli = cli_main(["test", *args, "--ckpt_path", ckpt])
    assert {"test/r1_t2i", "test/r1_i2t", "test/r10_t2i", "test/loss"} <= set(cli.trainer.callback_metrics)
    out = tmp_path / "embeddings"
    predict = ["predict", *args, "--ckpt_path", ckpt]
    writes_out = callback_args(tmp_path, EmbeddingWriter={"output_dir": str(out)})
    cli_main([*predict, *writes_out])
    data = torch.load(out / "embeddings_rank0.pt", weights_only=True)
    num_test_captions = 24 * 2  # 24 test images, 2 captions each
    assert data["text_embeddings"].shape[0] == num_test_captions == data["index"].shape[0]
    assert torch.allclose(data["text_embeddings"].norm(dim=-1), torch.ones(num_test_captions), atol=1e-4)

    # A second predict into the same folder is refused; with overwrite, an earlier run's files are replaced.
    stale = out / "embeddings_rank1.npz"
    stale.write_bytes(b"from an earlier 2-process run")
    with pytest.raises(FileExistsError, match="overwrite: true"):
        cli_main([*predict, *writes_out])
    cli_main(
        [*predict, *callback_args(tmp_path, EmbeddingWriter={"output_dir": str(out), "overwrite": True})]
    )
    assert sorted(p.name for p in out.iterdir()) == ["embeddings_rank0.pt"]
    # an output path that is a file is named, with what to give instead
    a_file = tmp_path / "embeddings.pt"
    a_file.write_bytes(b"")
    with pytest.raises(FileExistsError, match=rf"output_dir {a_file} is a file, not a folder"):
        cli_main([*predict, *callback_args(tmp_path, EmbeddingWriter={"output_dir": str(a_file)})])


def resumed_elsewhere(tiny_run: TinyRun, folder: Path) -> list[str]:
    """Arguments that resume the tiny run for one more step, writing into ``folder``."""
    return [
        *tiny_demo_args(tiny_run.root, max_steps=7), "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(folder), *callback_args(folder),
    ]  # fmt: skip


def test_resume_with_other_options_warns_listing_them(tiny_run: TinyRun, tmp_path: Path) -> None:
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    args = [
        *resumed_elsewhere(tiny_run, tmp_path),
        "--model.fusion.heads",
        "2",
        "--data.init_args.batch_size",
        "8",
    ]
    args += ["--data.loader.caption_sampling", "all"]  # one key of a group
    with pytest.warns(UserWarning, match="Resuming from") as caught:
        cli = cli_main(["fit", *args, "--ckpt_path", ckpt])
    message = next(str(w.message) for w in caught if "Resuming from" in str(w.message))
    assert "model.fusion.heads: given 2, used 4" in message  # the checkpoint's architecture wins
    assert "data.batch_size: given 8, checkpoint 16" in message  # data options are taken as given
    assert "data.loader.caption_sampling: given 'all', checkpoint 'random'" in message
    assert cli.model.hparams["fusion"]["heads"] == 4 and cli.datamodule.hparams.batch_size == 8


def test_resume_compares_data_option_keys_left_out_with_their_defaults(
    tiny_run: TinyRun, tmp_path: Path
) -> None:
    ckpt = torch.load(tiny_run.checkpoint_dir / "last.ckpt", weights_only=True)
    saved = ckpt["datamodule_hyper_parameters"]
    saved["loader"]["pad_to_multiple_of"] = 8  # a key of a group the resume gives in part
    saved["images"]["horizontal_flip"] = True  # a group the resume leaves out
    changed = tmp_path / "changed.ckpt"
    torch.save(ckpt, changed)
    args = ["fit", *resumed_elsewhere(tiny_run, tmp_path / "resumed")]
    with pytest.warns(UserWarning, match="Resuming from") as caught:
        cli_main([*args, "--ckpt_path", str(changed)])
    message = next(str(w.message) for w in caught if "Resuming from" in str(w.message))
    assert "data.loader.pad_to_multiple_of: given None, checkpoint 8" in message
    assert "data.images.horizontal_flip: given False, checkpoint True" in message
    # control: the checkpoint as the run wrote it differs in no data option
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli_main(
            [
                "fit",
                *resumed_elsewhere(tiny_run, tmp_path / "control"),
                "--ckpt_path",
                str(tiny_run.checkpoint_dir / "last.ckpt"),
            ]
        )
    assert [str(w.message) for w in caught if "data options differ" in str(w.message)] == []


def test_a_second_run_into_the_same_folder_is_refused(
    tiny_run: TinyRun, capsys: pytest.CaptureFixture
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_run.checkpoint_dir.iterdir()}
    assert "last.ckpt" in before

    with pytest.raises(SystemExit) as refused:
        cli_main(["fit", *tiny_demo_args(tiny_run.root)])
    assert refused.value.code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert f"{tiny_run.checkpoint_dir} already holds an earlier run's checkpoints (" in message
    assert "last.ckpt" in message and "--ckpt_path last" in message
    assert f"--trainer.default_root_dir {tiny_run.root}-2" in message
    assert {p.name: p.stat().st_mtime_ns for p in tiny_run.checkpoint_dir.iterdir()} == before


def test_resuming_the_run_is_not_refused(tiny_run: TinyRun, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run.checkpoint_dir, run / "checkpoints")
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    # one step past where it stopped (at its limits it would have nothing to train: refused, tested elsewhere)
    further = ["--trainer.max_steps", str(saved + 1), "--trainer.max_epochs", "2"]
    cli = cli_main(["fit", *tiny_demo_args(run), *further, "--ckpt_path", "last"])
    assert cli.trainer.global_step == saved + 1


@pytest.mark.slow
def test_module_entry_point_runs(capsys: pytest.CaptureFixture) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mm_lightning", "fit", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # a bare LightningCLI prints about 500 lines; the default callbacks, listed as trainer.callbacks' default, ~35
    # more; the three checkpoint groups, Lightning's ModelCheckpoint documentation each, ~150 each
    assert len(result.stdout.splitlines()) <= 1120
    # a part's option names the built-in ones, not every nn.Module subclass loaded
    assert "built in: mm_lightning.models.{towers,losses}" in result.stdout
    assert "known subclasses: torch.nn.Module" not in " ".join(result.stdout.split())
    assert (
        "--model.fusion.heads" in result.stdout
        and "--trainer.callbacks.help CLASS_PATH_OR_NAME" in result.stdout
    )
    # no option that would replace the module's optimizer groups and schedule (control: LightningCLI's default)
    assert "--optimizer" not in result.stdout and "--lr_scheduler" not in result.stdout
    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"], auto_configure_optimizers=True)
    assert "--optimizer " in capsys.readouterr().out
    # a callback's own options, as the help says to ask for them (in this process: no second start-up)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--trainer.callbacks.help", "ModelCheckpoint"])
    assert exit_info.value.code == 0 and "--trainer.callbacks.every_n_train_steps" in capsys.readouterr().out


def test_the_end_of_a_run_says_what_it_produced_and_the_printed_commands_work(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Standard output is not a terminal here (captured), as under nohup or SLURM: plain progress lines.
    cli_main(["fit", *tiny_demo_args(tmp_path, max_steps=4, callbacks={"ProgressLines": {"every_s": 0}})])
    out = capsys.readouterr().out
    assert "epoch 1/1 step 1/4 (25%)  train/loss " in out and "steps/s" in out and "left ~" in out
    assert "epoch 1 step 3 validated: val/r1_t2i " in out
    summary = out[out.index("Finished fit at step 4.") :].splitlines()
    best = next(line for line in summary if line.startswith("  best val/r1_t2i: "))
    best_path = best.split()[-1]
    assert Path(best_path).exists() and Path(best_path).parent == tmp_path / "checkpoints"
    assert f"  last checkpoint: {tmp_path / 'checkpoints' / 'last.ckpt'}" in summary
    assert any(line.startswith(f"  logs: {tmp_path / 'version_0'}") for line in summary)
    test_it = next(line for line in summary if line.startswith("  test it: python -m mm_lightning "))
    assert main(shlex.split(test_it.split("python -m mm_lightning ", 1)[1])) == 0
    assert "Finished test: test/r1_t2i " in capsys.readouterr().out


def test_progress_lines_stay_quiet_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer(logger=False, accelerator="cpu", enable_progress_bar=False, enable_checkpointing=False)
    lines = ProgressLines()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    lines.setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert not lines._active
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    lines.setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert lines._active
