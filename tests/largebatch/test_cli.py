"""The large-batch options from the command line reach the module (training itself: test_module_chunks)."""

from __future__ import annotations

from pathlib import Path

from mm_lightning.cli import cli_main
from mm_lightning.extras.gradient_caching import GradientCaching
from mm_lightning.models.losses.siglip import SigLipLoss
from tests.conftest import tiny_demo_args


def test_siglip_chunks_and_compile_options_from_the_cli(tmp_path: Path) -> None:
    args = [
        "--model.loss",
        "mm_lightning.models.losses.SigLipLoss",
        "--model.batch_embedding",
        "mm_lightning.extras.GradientCaching",
        "--model.batch_embedding.chunks",
        "4",
        "--model.loss.init_args.bias_init",
        "-5",
    ]
    model = cli_main(
        [*tiny_demo_args(tmp_path, *args, "--model.compile", "{mode: max-autotune}")], run=False
    ).model
    assert (
        isinstance(model.model.contrastive, SigLipLoss) and model.model.contrastive.logit_bias.item() == -5.0
    )
    assert isinstance(model.batch_embedding, GradientCaching) and model.batch_embedding.chunks == 4
    assert model.hparams.compile == {"mode": "max-autotune"}
