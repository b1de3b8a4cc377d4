"""Zero-shot classification: data formats, the metric against hand-computed accuracy, the callback's logging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from PIL import Image
from torchmetrics.classification import MulticlassAccuracy

from mm_lightning.assets import DEMO_BERT
from mm_lightning.data.collate import load_tokenizer
from mm_lightning.data.transforms import Normalize
from mm_lightning.evaluation.zeroshot import ZeroShotEvaluation, evaluate, load_labeled_images

COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


class ColorNet(torch.nn.Module):
    """Embeds a caption by the colour word it names and an image by its dominant channel (a known classifier)."""

    def __init__(self) -> None:
        super().__init__()
        tokenizer = load_tokenizer(DEMO_BERT)
        self.register_buffer("color_ids", torch.tensor(tokenizer.convert_tokens_to_ids(list(COLORS))))
        self.scale = torch.nn.Parameter(torch.ones(()))

    def embed_text(self, input_ids, attention_mask, token_type_ids=None):
        return (input_ids[:, :, None] == self.color_ids).any(1).float()

    def embed_images(self, images):
        return torch.nn.functional.one_hot(images.mean((2, 3)).argmax(1), 3).float() * self.scale


class ColorModel(LightningModule):
    """A LightningModule holding its network as ``model``, as ``MultimodalModule`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ColorNet()

    def validation_step(self, batch, batch_idx):
        return None


def _image_folder(root: Path, mislabeled: int = 1) -> Path:
    """3 colour classes x 3 images; ``mislabeled`` blue images are filed under red."""
    for name, rgb in COLORS.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(3):
            color = COLORS["blue"] if name == "red" and i < mislabeled else rgb
            Image.new("RGB", (20, 16), color).save(root / name / f"{i}.png")
    return root


def test_top1_counts_the_right_images_and_ranks_split_the_work(tmp_path: Path) -> None:
    images = load_labeled_images(str(_image_folder(tmp_path / "colors")))
    assert images.classnames == ["blue", "green", "red"] and len(images.paths) == 9
    tokenizer, norm = load_tokenizer(DEMO_BERT), Normalize((0.0,) * 3, (1.0,) * 3)
    metric = {1: MulticlassAccuracy(3, top_k=1, average="micro")}
    scores = evaluate(ColorNet(), images, ["a {} square."], tokenizer, norm, 8, 16, 4, metric)
    assert float(scores[1]) == pytest.approx(8 / 9)
    # each rank scores a disjoint share: the counts of two shares add up to the whole
    halves = [
        evaluate(ColorNet(), images, ["a {} square."], tokenizer, norm, 8, 16, 2, metric, rank, 2)
        for rank in (0, 1)
    ]
    assert sorted(float(h[1]) for h in halves) == pytest.approx(sorted([4 / 5, 4 / 4]))


def test_jsonl_labels_and_bad_lines(tmp_path: Path) -> None:
    folder = _image_folder(tmp_path / "colors", mislabeled=0)
    lines = [{"image": f"colors/{c}/0.png", "label": c} for c in COLORS]
    (tmp_path / "set.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    images = load_labeled_images(str(tmp_path / "set.jsonl"))
    assert [images.classnames[i] for i in images.labels] == list(COLORS)
    assert Path(images.paths[0]) == folder / "red" / "0.png"
    (tmp_path / "bad.jsonl").write_text(json.dumps(lines[0]) + '\n{"image": "x.png"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        load_labeled_images(str(tmp_path / "bad.jsonl"))
    (tmp_path / "unknown.jsonl").write_text(json.dumps(lines[0]))
    with pytest.raises(ValueError, match="not one of the class names"):
        load_labeled_images(str(tmp_path / "unknown.jsonl"), classnames=["green"])


def test_callback_logs_next_to_validation(tmp_path: Path) -> None:
    from mm_lightning.data import DemoDataModule

    data = DemoDataModule(
        data_dir=str(tmp_path / "demo"),
        render_size=32,
        train_renders=1,
        num_val=8,
        num_test=8,
        batch_size=8,
        num_workers=0,
        tokenizer=DEMO_BERT,
        images={"size": 32, "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)},
    )
    callback = ZeroShotEvaluation(
        "colors", str(_image_folder(tmp_path / "colors")), templates=["a {} shape."]
    )
    trainer = Trainer(
        accelerator="cpu", callbacks=[callback], logger=False, enable_progress_bar=False,
        enable_checkpointing=False, limit_val_batches=1,
    )  # fmt: skip
    metrics = trainer.validate(ColorModel(), datamodule=data, verbose=False)[0]
    assert metrics["zeroshot/colors/top1"] == pytest.approx(8 / 9)
    assert "zeroshot/colors/top5" not in metrics  # only 3 classes


def _two_rank_worker(rank: int, port: int, folder: str, out: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        images = load_labeled_images(folder)
        tokenizer, norm = load_tokenizer(DEMO_BERT), Normalize((0.0,) * 3, (1.0,) * 3)
        metric = {1: MulticlassAccuracy(3, top_k=1, average="micro")}
        scores = evaluate(ColorNet(), images, ["a {} square."], tokenizer, norm, 8, 16, 2, metric, rank, 2)
        torch.save(float(scores[1]), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_report_the_accuracy_of_all_images(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    folder = _image_folder(tmp_path / "colors")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_rank_worker, args=(port, str(folder), str(tmp_path)), nprocs=2, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # each rank scored its own share (4/5 and 4/4 alone, see above); the synced metric is the whole set's
    assert per_rank == pytest.approx([8 / 9, 8 / 9])
