"""Evaluation: each distinct image is encoded once, with the same metrics as encoding every caption row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, Dataset

from mm_lightning.evaluation.metrics import retrieval_metrics
from tests.models.helpers import make_batch, tiny_module

ROWS, CAPTIONS = 24, 3  # 8 images, 3 captions each, consecutive rows


class MultiCaption(Dataset):
    """COCO-like rows: one row per caption, the image repeated on each of its caption rows."""

    def __init__(self) -> None:
        self.batch = make_batch(size=ROWS, length=7, captions_per_image=CAPTIONS, seed=4)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def _validate(model, data, tmp_path: Path) -> dict[str, float]:
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, deterministic=True,
    )  # fmt: skip
    return trainer.validate(model, data, verbose=False)[0]


def test_validation_encodes_each_image_once_per_batch(tmp_path: Path) -> None:
    model = tiny_module()
    rows_seen: list[int] = []
    model.model.image_encoder.register_forward_hook(
        lambda module, args, out: rows_seen.append(args[0].shape[0])
    )
    _validate(model, DataLoader(MultiCaption(), batch_size=6), tmp_path)
    assert rows_seen == [2, 2, 2, 2]  # 2 distinct images per batch of 6 caption rows (was 6 each)


def test_metrics_equal_encoding_every_row(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_module().eval()
    data = MultiCaption().batch
    with torch.no_grad():
        per_row = model(data)  # every caption row encodes its image (the previous evaluation)
    want = retrieval_metrics(per_row["image_embeddings"], per_row["text_embeddings"], data["image_id"])
    # batches of 5 rows: some images have captions in two batches
    got = _validate(model, DataLoader(MultiCaption(), batch_size=5), tmp_path)
    for key, value in want.items():
        assert got[f"val/{key}"] == pytest.approx(value.item(), abs=1e-6), key
    # control: another model's embeddings give other numbers, so the comparison can fail
    other = tiny_module().eval()
    with torch.no_grad():
        rows = other(data)
    control = retrieval_metrics(rows["image_embeddings"], rows["text_embeddings"], data["image_id"])
    assert any(abs(control[k].item() - want[k].item()) > 1e-3 for k in want)


def test_val_loss_is_the_objective_on_every_row() -> None:
    """Deduplicated image encoding leaves the validation loss unchanged (ITM off: no sampled negatives)."""
    torch.manual_seed(0)
    model = tiny_module(objective={"itm_weight": 0.0}).eval()
    batch = make_batch(size=6, captions_per_image=2)
    with torch.no_grad():
        emb = model(batch)
        want = model.model.contrastive(emb["image_embeddings"], emb["text_embeddings"], batch["image_id"])
        logged = {}
        model.log_dict = lambda values, **kwargs: logged.update(values)
        model.on_validation_epoch_start()
        model.validation_step(batch, 0)
        model.on_validation_epoch_end()
    assert logged["val/loss"] == pytest.approx(want.item(), abs=1e-6)


def test_skipped_records_change_no_metric_on_one_device(tmp_path: Path) -> None:
    """Under on_bad_record=skip, undecodable images are replaced by valid samples (which then appear twice):
    the metrics must equal those of the valid records alone."""
    from mm_lightning.data import MultimodalDataModule
    from mm_lightning.evaluation.validation import Evaluation
    from tests.data.helpers import coco_style, write_jsonl

    clean = coco_style(tmp_path, num_images=6, captions_per_image=2)
    (tmp_path / "images" / "broken.jpg").write_text(
        "<html>404 not found</html>"
    )  # an error page saved as .jpg
    lines = clean.read_text().splitlines()
    bad = {"image": "images/broken.jpg", "text": ["a broken image", "still broken"]}
    dirty = write_jsonl(tmp_path / "dirty.jsonl", [lines[0], bad, *lines[1:4], bad, *lines[4:]])

    def metrics(val_file: Path, rows: list[int]) -> dict[str, float]:
        dm = MultimodalDataModule(
            val_file=str(val_file),
            tokenizer="mm-lightning/demo-bert",
            max_length=16,
            batch_size=5,
            on_bad_record="skip",
            images={"size": 32},
        )
        torch.manual_seed(0)
        model = tiny_module().eval()
        model.evaluation = Evaluation()
        model.evaluation.retrieval.update = _counting(model.evaluation.retrieval.update, rows)
        return _validate(model, dm, tmp_path)

    clean_rows: list[int] = []
    dirty_rows: list[int] = []
    want = metrics(clean, clean_rows)
    got = metrics(dirty, dirty_rows)
    assert sum(dirty_rows) > sum(clean_rows) == 12  # replacement duplicates really reached the metric
    for key in ("r1_t2i", "r1_i2t", "r5_t2i", "alignment_gap"):
        assert got[f"val/{key}"] == pytest.approx(want[f"val/{key}"], abs=1e-6), key


def _counting(update, rows: list[int]):
    def wrapped(image_emb, image_ids, text_emb, text_image_ids, index):
        rows.append(len(index))
        return update(image_emb, image_ids, text_emb, text_image_ids, index)

    return wrapped


def _records_with_broken_images(root: Path) -> tuple[Path, Path]:
    """8 good images (2 captions each) alone, and the same with 4 undecodable ones among them."""
    from tests.data.helpers import coco_style, write_jsonl

    clean = coco_style(root, num_images=8, captions_per_image=2)
    (root / "images" / "broken.jpg").write_text("<html>404 not found</html>")  # an error page saved as .jpg
    lines = clean.read_text().splitlines()
    bad = {"image": "images/broken.jpg", "text": ["a broken image", "still broken"]}
    mixed = [lines[0], bad, lines[1], lines[2], bad, bad, *lines[3:6], bad, *lines[6:]]
    return clean, write_jsonl(root / "with_broken.jsonl", mixed)


BATCH_SIZES = (3, 4)


def _val_loss(val_file: Path, batch_size: int, devices: int, root: Path) -> float:
    """``val/loss`` of a tiny model on ``val_file``. With 2 devices it must run in processes that
    ``tests/strategies/launch.py`` started (in pytest's own process, ``ddp`` would relaunch the pytest command)."""
    from lightning.pytorch import seed_everything

    from mm_lightning.data import MultimodalDataModule

    data = MultimodalDataModule(
        val_file=str(val_file),
        tokenizer="mm-lightning/demo-bert",
        max_length=16,
        batch_size=batch_size,
        on_bad_record="skip",
        images={"size": 32},
    )
    seed_everything(0)
    model = tiny_module()  # with the ITM head: its loss term samples negatives
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, deterministic=True,
    )  # fmt: skip
    trainer.validate(model, data, verbose=False)
    return float(trainer.callback_metrics["val/loss"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_val_loss_does_not_depend_on_where_skipped_records_fell(tmp_path: Path) -> None:
    """Broken records skipped leave ``val/loss`` as the good records alone give it, at any batch size and on 1 or
    2 processes: it is scored on chunks of records in file order, not on the batches they arrived in."""
    import json

    from tests.strategies.launch import run_ranks

    clean, with_broken = _records_with_broken_images(tmp_path)
    out = tmp_path / "two_processes.json"
    ranks = run_ranks(["tests/models/val_loss_worker.py", str(clean), str(with_broken), str(out)], tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].output[-3000:] + ranks[1].output[-3000:]
    two = json.loads(out.read_text())
    for batch_size in BATCH_SIZES:
        alone = {1: _val_loss(clean, batch_size, 1, tmp_path), 2: two[f"clean/{batch_size}"]}
        skipped = {1: _val_loss(with_broken, batch_size, 1, tmp_path), 2: two[f"with_broken/{batch_size}"]}
        for devices in (1, 2):
            assert skipped[devices] == pytest.approx(alone[devices], abs=1e-6), (batch_size, devices)
        assert alone[2] == pytest.approx(alone[1], abs=1e-5)  # and the number of processes does not matter


def test_val_loss_control_batch_by_batch_depends_on_skips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: scored batch by batch (each batch's valid rows a chunk of their own), the skips change the value."""
    from mm_lightning.evaluation.validation import ChunkedLoss

    clean, with_broken = _records_with_broken_images(tmp_path)
    add = ChunkedLoss.add

    def batch_by_batch(self, model, rows, term_weights, batch_rows):
        self.size = len(rows["index"])
        add(self, model, rows, term_weights, batch_rows)

    monkeypatch.setattr(ChunkedLoss, "add", batch_by_batch)
    assert abs(_val_loss(with_broken, 3, 1, tmp_path) - _val_loss(clean, 3, 1, tmp_path)) > 1e-3
