"""The command line: overrides, linked arguments, clear errors, and fit -> validate/test/predict on real runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mm_lightning.cli import cli_main
from tests.conftest import REPO, TinyRun, tiny_demo_args


def test_overrides_reach_the_objects(tmp_path: Path) -> None:
    cli = cli_main(
        [*tiny_demo_args(tmp_path), "--model.fusion.heads", "2", "--data.batch_size", "8"], run=False
    )
    assert cli.model.hparams.fusion["heads"] == 2
    attention = [m for m in cli.model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert attention and all(m.num_heads == 2 for m in attention)
    assert cli.datamodule.hparams.batch_size == 8
    # Linked arguments: the tokenizer follows the text encoder, the image size follows the data.
    assert cli.datamodule.hparams.tokenizer == cli.model.hparams.text["name"] == "mm-lightning/demo-bert"
    assert cli.model.hparams.image["image_size"] == cli.datamodule.hparams.image_size == 32


def test_tokenizer_always_follows_the_text_encoder(tmp_path: Path) -> None:
    # jsonargparse applies the link after parsing: a tokenizer set on its own cannot disagree with the encoder.
    cli = cli_main([*tiny_demo_args(tmp_path), "--data.init_args.tokenizer", "bert-base-uncased"], run=False)
    assert cli.datamodule.hparams.tokenizer == "mm-lightning/demo-bert"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (["--data.batch_size", "many"], "batch_size"),
        (["--model.text.pooling", "max"], "text.pooling"),
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
    monitor = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("ResilientCheckpoint"))
    assert monitor["monitor"] == "val/r1_t2i"
    saved = (tiny_run.log_dir / "config.yaml").read_text()
    assert "mm_lightning.data.DemoDataModule" in saved and "heads: 4" in saved


def test_validate_test_predict_from_checkpoint(tiny_run: TinyRun, tmp_path: Path) -> None:
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    args = tiny_demo_args(tiny_run.root)
    cli = cli_main(["validate", *args, "--ckpt_path", ckpt])
    assert 0.0 <= float(cli.trainer.callback_metrics["val/r1_t2i"]) <= 1.0
    cli = cli_main(["test", *args, "--ckpt_path", ckpt])
    assert {"test/r1_t2i", "test/r1_i2t", "test/r10_t2i", "test/loss"} <= set(cli.trainer.callback_metrics)
    out = tmp_path / "embeddings"
    cli_main(["predict", *args, "--ckpt_path", ckpt, "--prediction.output_dir", str(out)])
    data = torch.load(out / "embeddings_rank0.pt", weights_only=True)
    num_test_captions = 24 * 2  # 24 test images, 2 captions each
    assert data["text_embeddings"].shape[0] == num_test_captions == data["index"].shape[0]
    assert torch.allclose(data["text_embeddings"].norm(dim=-1), torch.ones(num_test_captions), atol=1e-4)


@pytest.mark.slow
def test_module_entry_point_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mm_lightning", "fit", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--model.fusion.heads" in result.stdout and "--checkpoint.every_n_train_steps" in result.stdout
