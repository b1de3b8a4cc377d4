"""Fine-tune a CLIP / SigLIP directory through the CLI, export it, reload it with transformers as-is."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers as hf

from mm_lightning.cli import cli_main, main
from mm_lightning.models import MultimodalModule
from tests.conftest import REPO, tiny_demo_args
from tests.towers.dual_encoders import save_tiny
from tests.towers.test_zeroshot import _image_folder

pytest.importorskip("open_clip")  # its CLIP vocabulary gives the tiny directory a real tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_finetune_then_export_reloads_with_the_same_embeddings(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / kind
    reference = save_tiny(kind, source, tokenizer=True)
    args = tiny_demo_args(tmp_path, max_steps=2)
    args[args.index("--config") + 1] = str(REPO / "configs" / "finetune_clip.yaml")
    args += [
        "--model.image_tower.init_args.name", str(source), "--model.text_tower.init_args.name", str(source),
        "--model.embed_dim", str(16 if kind == "clip" else 32), "--model.optim.lr", "1e-3",
        "--data.init_args.max_length", "32", "--trainer.deterministic", "true",
    ]  # fmt: skip
    torch.manual_seed(0)
    module = cli_main(["fit", *args]).model.eval()
    # the module started from the source: its temperature is the directory's learned one (trained 2 steps)
    assert float(module.model.contrastive.logit_scale.detach()) == pytest.approx(2.0, abs=0.05)
    out = tmp_path / "exported"
    assert (
        main(["export", "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt"), "--out", str(out)]) == 0
    )
    exported = hf.AutoModel.from_pretrained(out).eval()
    source_file = json.loads((out / "source_checkpoint.json").read_text())  # the export names its checkpoint
    digest = hashlib.sha256((tmp_path / "checkpoints" / "last.ckpt").read_bytes()).hexdigest()
    assert source_file["checkpoint_sha256"] == digest
    assert type(exported) is type(reference)
    tokenizer = hf.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["a small red star", "a large blue circle on gray"], padding=True, return_tensors="pt")
    images = torch.randn(2, 3, 32, 32)
    checkpoint = MultimodalModule.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt").eval()
    with torch.no_grad():
        want_text = checkpoint.model.embed_text(batch["input_ids"], batch["attention_mask"])
        want_image = checkpoint.model.embed_images(images)
        got_text = exported.get_text_features(**batch).pooler_output
        got_image = exported.get_image_features(pixel_values=images).pooler_output
        before = reference.get_image_features(pixel_values=images).pooler_output
    torch.testing.assert_close(torch.nn.functional.normalize(got_text, dim=-1), want_text, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.nn.functional.normalize(got_image, dim=-1), want_image, atol=1e-5, rtol=0
    )
    # control: fine-tuning changed the weights, so the source directory's features differ from the export's
    assert (torch.nn.functional.normalize(before, dim=-1) - want_image).abs().max() > 1e-4
    assert hf.AutoImageProcessor.from_pretrained(out).image_mean == pytest.approx([0.4, 0.5, 0.6])
    # the zero-shot command runs on the same checkpoint (3 colour classes: top-5 is left out)
    folder = _image_folder(tmp_path / "colors")
    capsys.readouterr()
    assert (
        main(["zeroshot", "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt"), "--data", str(folder)])
        == 0
    )
    assert capsys.readouterr().out.startswith("acc1=")


@pytest.mark.parametrize("command", [["export", "--out", "x"], ["zeroshot", "--data", "x"]])
def test_checkpoint_commands_name_a_missing_checkpoint(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "missing.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        main([command[0], "--ckpt_path", missing, *command[1:]])
    assert exit_info.value.code == 2
    assert f"--ckpt_path {missing!r} does not exist" in capsys.readouterr().err
