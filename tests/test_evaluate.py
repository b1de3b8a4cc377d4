"""``evaluate``: its retrieval figures equal CLIP_benchmark's own functions on the same embeddings, equal validation's
on the same split, and are the same on 1 and 2 processes; results in CLIP_benchmark's layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clip_benchmark.metrics import zeroshot_retrieval

from mm_lightning.cli import cli_main, main
from mm_lightning.evaluate import markdown_tables, prompt_templates
from tests.conftest import DEMO_CONFIG, REPO, TinyRun, tiny_demo_args

KS = (1, 5, 10)
RETRIEVAL_KEYS = {f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in KS} | {
    f"{d}_retrieval_{s}_rank" for d in ("image", "text") for s in ("mean", "median")
}


class StoredEmbeddings(torch.nn.Module):
    """CLIP_benchmark's model interface over embeddings the project computed: inputs are row numbers."""

    def __init__(self, images: torch.Tensor, texts: torch.Tensor) -> None:
        super().__init__()
        self.images, self.texts = images, texts

    def encode_image(self, rows: torch.Tensor) -> torch.Tensor:
        return self.images[rows]

    def encode_text(self, rows: torch.Tensor) -> torch.Tensor:
        return self.texts[rows]


def clip_benchmark_on(predicted: dict, captions_per_image: int | None = None) -> dict[str, float]:
    """CLIP_benchmark's retrieval evaluation of the predicted embeddings (its loader: an image and its captions)."""
    image_ids = predicted["image_id"].tolist()
    distinct = list(dict.fromkeys(image_ids))
    first_row = {image: image_ids.index(image) for image in distinct}
    captions = {image: [str(r) for r, i in enumerate(image_ids) if i == image] for image in distinct}
    items = [(first_row[image], captions[image][:captions_per_image]) for image in distinct]
    loader = torch.utils.data.DataLoader(
        items, batch_size=5, collate_fn=lambda b: (torch.tensor([r for r, _ in b]), [c for _, c in b])
    )
    model = StoredEmbeddings(predicted["image_embeddings"], predicted["text_embeddings"])
    tokenizer = lambda texts: torch.tensor([int(t) for t in texts])  # noqa: E731
    return zeroshot_retrieval.evaluate(model, loader, tokenizer, "cpu", amp=False, recall_k_list=list(KS))


def read_results(folder: Path) -> dict:
    files = list(folder.glob("*_zeroshot_retrieval.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


@pytest.fixture(scope="module")
def evaluated(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    """The tiny run's last checkpoint, evaluated on the test split, and its embeddings from ``predict``."""
    out = tmp_path_factory.mktemp("evaluate")
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    args = tiny_demo_args(tiny_run.root)
    assert main(["evaluate", *args, "--ckpt_path", ckpt, "--output", str(out / "results")]) == 0
    cli_main(["predict", *args, "--ckpt_path", ckpt, "--prediction.output_dir", str(out / "embeddings")])
    predicted = torch.load(out / "embeddings" / "embeddings_rank0.pt", weights_only=True)
    return read_results(out / "results"), predicted, out


def test_results_are_in_clip_benchmarks_layout(evaluated: tuple[dict, dict, Path]) -> None:
    results, _, out = evaluated
    assert {"dataset", "model", "pretrained", "task", "metrics", "language"} <= set(results)
    assert (results["task"], results["dataset"], results["images"], results["captions"]) == (
        "zeroshot_retrieval",
        "test",
        24,
        48,
    )
    assert set(results["metrics"]) == RETRIEVAL_KEYS
    table = (out / "results" / "results.md").read_text()
    assert table == markdown_tables([results])
    r1 = results["metrics"]["image_retrieval_recall@1"]
    assert f"| test | 24 | 48 | {100 * r1:.2f} |" in table


def test_retrieval_equals_clip_benchmark(evaluated: tuple[dict, dict, Path]) -> None:
    results, predicted, _ = evaluated
    theirs = clip_benchmark_on(predicted)
    ours = results["metrics"]
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, abs=1e-6), key
    assert 0 < ours["text_retrieval_recall@1"] < 1 and 0 < ours["image_retrieval_recall@5"] < 1  # not trivial

    # Control: under another rule (an image's first caption only) the same embeddings score differently.
    first_only = clip_benchmark_on(predicted, captions_per_image=1)
    assert any(abs(first_only[key] - ours[key]) > 1e-3 for key in first_only)


def test_validation_on_the_same_split_reports_the_same_recall(
    tiny_run: TinyRun, evaluated: tuple[dict, dict, Path], tmp_path: Path
) -> None:
    results, _, _ = evaluated
    test_as_val = {"val_file": str(tiny_run.root / "demo" / "test.jsonl"), "batch_size": 16, "num_workers": 0}
    args = [
        "--config", str(DEMO_CONFIG),
        "--data", json.dumps({"class_path": "mm_lightning.data.MultimodalDataModule", "init_args": test_as_val}),
        "--model.image_tower.init_args.image_size", "32",
        "--trainer.default_root_dir", str(tmp_path),
        "--ckpt_path", str(tiny_run.checkpoint_dir / "last.ckpt"),
    ]  # fmt: skip
    metrics = cli_main(["validate", *args]).trainer.callback_metrics
    for k in KS:
        assert float(metrics[f"val/r{k}_t2i"]) == pytest.approx(
            results["metrics"][f"image_retrieval_recall@{k}"]
        )
        assert float(metrics[f"val/r{k}_i2t"]) == pytest.approx(
            results["metrics"][f"text_retrieval_recall@{k}"]
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_give_the_same_results(tiny_run: TinyRun, evaluated: tuple[dict, dict, Path]) -> None:
    results, _, out = evaluated
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    cmd = [
        sys.executable, "-m", "mm_lightning", "evaluate", *tiny_demo_args(tiny_run.root), "--ckpt_path", ckpt,
        "--output", str(out / "two"), "--trainer.devices", "2", "--trainer.strategy", "ddp",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "| test | 24 | 48 |" in done.stdout  # the table is printed
    assert read_results(out / "two")["metrics"] == results["metrics"]


def test_templates_by_name_file_or_list(tmp_path: Path) -> None:
    openai = prompt_templates(None)
    assert len(openai) == 80 and openai == prompt_templates(["openai"])
    assert openai[0] == "a bad photo of a {}." and all(t.count("{}") == 1 for t in openai)
    listed = tmp_path / "mine.txt"
    listed.write_text("a photo of a {}.\n\na drawing of a {}.\n")
    assert prompt_templates([str(listed)]) == ["a photo of a {}.", "a drawing of a {}."]
    assert prompt_templates(["a {}.", "the {}."]) == ["a {}.", "the {}."]
