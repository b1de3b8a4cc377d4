"""``evaluate``: its retrieval figures equal CLIP_benchmark's own functions on the same embeddings, equal validation's
on the same split, and are the same on 1 and 2 processes; results in CLIP_benchmark's layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from clip_benchmark.metrics import zeroshot_classification, zeroshot_retrieval

from mm_lightning.cli import cli_main, main
from mm_lightning.commands.evaluate import (
    NotComparable,
    add_comparisons,
    add_intervals,
    check_baseline_folder,
    figures_of,
    markdown_tables,
    prompt_templates,
    queries_file,
    read_list,
    read_queries,
)
from mm_lightning.data.collate import load_tokenizer
from mm_lightning.data.images import decode_image_file
from mm_lightning.data.transforms import Normalize, eval_transform
from mm_lightning.evaluation.intervals import Bootstrap, paired_differences
from mm_lightning.models import DualEncoder
from tests.conftest import DEMO_CONFIG, TinyRun, callback_args, tiny_demo_args
from tests.test_process_exit import run_or_report_hang

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


def read_results(folder: Path, task: str = "zeroshot_retrieval") -> dict:
    """The one result file of ``task``, not counting re-ranked ones."""
    files = [f for f in folder.glob(f"*_{task}.json") if "+itm_rerank" not in f.name]
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


class ClipInterface(torch.nn.Module):
    """CLIP_benchmark's model interface (``encode_image``, ``encode_text``) over the project's network."""

    def __init__(self, network: DualEncoder) -> None:
        super().__init__()
        self.network = network

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.network.embed_images(images)

    def encode_text(self, tokens: dict) -> torch.Tensor:
        return self.network.embed_text(**tokens)


class LabeledImages(torch.utils.data.Dataset):
    def __init__(self, images: torch.Tensor, labels: list[int], classes: list[str]) -> None:
        self.images, self.labels, self.classes = images, labels, classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], self.labels[i]


def colors_of(demo: Path) -> list[tuple[str, str]]:
    """(image path, its shape's color) of each test image: the demo's captions start "a <size> <color> ..."."""
    records = [json.loads(line) for line in (demo / "test.jsonl").read_text().splitlines()]
    return [(str(demo / r["image"]), r["text"][0].split()[2]) for r in records]


@pytest.fixture(scope="module")
def evaluated(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    """The tiny run's last checkpoint, evaluated on the test split and on its images labeled by color, and its
    embeddings from ``predict``."""
    out = tmp_path_factory.mktemp("evaluate")
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    args = tiny_demo_args(tiny_run.root)
    labeled = out / "colors.jsonl"
    labeled.write_text(
        "".join(json.dumps({"image": i, "label": c}) + "\n" for i, c in colors_of(tiny_run.root / "demo"))
    )
    evaluate = [
        "evaluate",
        *args,
        "--ckpt_path",
        ckpt,
        "--output",
        str(out / "results"),
        "--zeroshot",
        str(labeled),
    ]
    assert main(evaluate) == 0
    writer = {"output_dir": str(out / "embeddings")}
    cli_main(["predict", *args, "--ckpt_path", ckpt, *callback_args(out, EmbeddingWriter=writer)])
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
    assert table == markdown_tables([results, read_results(out / "results", "zeroshot_classification")])
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


def numpy2_accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...] = (1,)) -> list[float]:
    """clip_benchmark 1.6.2's ``accuracy`` with one change: NumPy 2 refuses its ``float()`` of a 1-element array."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


def test_zero_shot_equals_clip_benchmark(
    tiny_run: TinyRun, evaluated: tuple[dict, dict, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, out = evaluated
    ours = read_results(out / "results", "zeroshot_classification")
    classes = sorted({color for _, color in colors_of(tiny_run.root / "demo")})
    assert (ours["dataset"], ours["images"], ours["classes"]) == ("colors", 24, len(classes)) and len(
        classes
    ) >= 5
    assert set(ours["metrics"]) == {"acc1", "acc5", "mean_per_class_recall"}

    network = DualEncoder.from_checkpoint(tiny_run.checkpoint_dir / "last.ckpt").eval()
    config = network.data_config["image"]
    resize = eval_transform(config["input_size"][-1], interpolation=config.get("interpolation", "bilinear"))
    labeled = colors_of(tiny_run.root / "demo")
    images = Normalize(tuple(config["mean"]), tuple(config["std"]))(
        torch.stack([resize(decode_image_file(path)) for path, _ in labeled])
    )
    data = LabeledImages(images, [classes.index(color) for _, color in labeled], classes)
    hf_tokenizer = load_tokenizer(network.data_config["text"]["tokenizer"])
    tokenizer = lambda texts: hf_tokenizer(texts, padding=True, return_tensors="pt")  # noqa: E731
    templates = [t.replace("{}", "{c}") for t in prompt_templates(None)]

    def theirs(templates: list[str]) -> dict[str, float]:
        loader = torch.utils.data.DataLoader(data, batch_size=5)
        return zeroshot_classification.evaluate(
            ClipInterface(network), loader, tokenizer, classes, templates, "cpu", amp=False
        )

    monkeypatch.setattr(zeroshot_classification, "accuracy", numpy2_accuracy)
    reference = theirs(templates)
    for key, value in ours["metrics"].items():
        assert value == pytest.approx(reference[key], abs=1e-6), key
    # unequal classes: accuracy and mean per-class recall weigh images differently, and both match
    assert len({sum(color == c for _, color in labeled) for c in classes}) > 1
    # Control: with one prompt instead of CLIP's 80 the classifier, and its scores, differ (24 images score in
    # steps of 1/24: some single prompts may tie with all 80, so several are tried).
    single = [theirs([template]) for template in templates[:8]]
    assert any(abs(one[key] - value) > 1e-3 for one in single for key, value in ours["metrics"].items())


@pytest.fixture(scope="module")
def reranked(tiny_run: TinyRun, evaluated: tuple[dict, dict, Path]) -> Path:
    """The same evaluation with every candidate re-scored by the matching head (48 >= the 24 test images)."""
    _, _, out = evaluated
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    args = ["--ckpt_path", ckpt, "--output", str(out / "reranked"), "--rerank_k", "48"]
    assert main(["evaluate", *tiny_demo_args(tiny_run.root), *args]) == 0
    return out / "reranked"


def test_rerank_writes_the_reranked_figures_beside_the_plain_ones(
    evaluated: tuple[dict, dict, Path], reranked: Path
) -> None:
    results, _, _ = evaluated
    plain = read_results(reranked)
    again = json.loads((reranked / "test+itm_rerank48_zeroshot_retrieval.json").read_text())
    assert plain["metrics"] == results["metrics"]  # re-ranking leaves the contrastive figures as they were
    assert set(again["metrics"]) == RETRIEVAL_KEYS and again["rerank"]["k"] == 48
    assert again["metrics"] != plain["metrics"]  # the head re-scored every candidate
    assert "| test+itm_rerank48 | 24 | 48 |" in (reranked / "results.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_give_the_same_results(
    tiny_run: TinyRun, evaluated: tuple[dict, dict, Path], reranked: Path
) -> None:
    results, _, out = evaluated
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    cmd = [
        sys.executable, "-m", "mm_lightning", "evaluate", *tiny_demo_args(tiny_run.root), "--ckpt_path", ckpt,
        "--output", str(out / "two"), "--trainer.devices", "2", "--trainer.strategy", "ddp",
        "--zeroshot", str(out / "colors.jsonl"), "--rerank_k", "48",
    ]  # fmt: skip
    done = run_or_report_hang(cmd, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:]
    assert "| test | 24 | 48 |" in done.stdout and "| colors | 24 |" in done.stdout  # the tables are printed
    assert read_results(out / "two")["metrics"] == results["metrics"]
    assert read_results(out / "two")["intervals"] == results["intervals"]  # the same queries, resampled alike
    one, two = (read_results(out / d, "zeroshot_classification") for d in ("results", "two"))
    assert two["metrics"] == pytest.approx(one["metrics"], abs=1e-6)
    name = "test+itm_rerank48_zeroshot_retrieval.json"
    one, two = (json.loads((folder / name).read_text()) for folder in (reranked, out / "two"))
    assert two["metrics"] == pytest.approx(one["metrics"], abs=1e-6)


def test_templates_by_name_file_or_list(tmp_path: Path) -> None:
    openai = prompt_templates(None)
    assert len(openai) == 80 and openai == prompt_templates(["openai"])
    assert openai[0] == "a bad photo of a {}." and all(t.count("{}") == 1 for t in openai)
    listed = tmp_path / "mine.txt"
    listed.write_text("a photo of a {}.\n\na drawing of a {}.\n")
    assert prompt_templates([str(listed)]) == ["a photo of a {}.", "a drawing of a {}."]
    assert prompt_templates(["a {}.", "the {}."]) == ["a {}.", "the {}."]
    names = tmp_path / "classes.json"
    names.write_text('["tench", "goldfish"]')
    assert read_list([str(names)]) == ["tench", "goldfish"] and read_list(["cat", "dog"]) == ["cat", "dog"]


def test_each_figure_has_its_interval_and_the_queries_give_back_the_figures(
    evaluated: tuple[dict, dict, Path],
) -> None:
    results, _, out = evaluated
    for task, keys in (
        ("zeroshot_retrieval", {f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in KS}),
        ("zeroshot_classification", {"acc1", "acc5", "mean_per_class_recall"}),
    ):
        dump = read_results(out / "results", task)
        assert set(dump["intervals"]) == keys
        assert dump["bootstrap"] | {"unit": None} == {
            "resamples": 1000, "seed": 0, "confidence": 0.95, "method": "percentile", "unit": None,
        }  # fmt: skip
        for key, (low, high) in dump["intervals"].items():
            assert low <= dump["metrics"][key] <= high, key
        assert any(low < high for low, high in dump["intervals"].values())  # 24 images leave room
        # the stored per-query outcomes give back the point estimates (CLIP_benchmark's, checked above)
        queries = read_queries(out / "results" / queries_file(f"{dump['dataset']}_{task}.json"), task)
        for key, value in figures_of(task, queries).values().items():
            assert value == pytest.approx(dump["metrics"][key], abs=1e-6), key  # theirs: float32
    table = (out / "results" / "results.md").read_text()
    assert (
        "95 % intervals (%): bootstrap over the test images (an image with its captions), 1000 resamples"
        in table
    )
    low, high = results["intervals"]["image_retrieval_recall@1"]
    assert f"| test | {100 * low:.2f}–{100 * high:.2f} |" in table


def test_a_checkpoint_compared_with_itself_differs_by_exactly_zero(
    tiny_run: TinyRun, evaluated: tuple[dict, dict, Path]
) -> None:
    _, _, out = evaluated
    ckpt = str(tiny_run.checkpoint_dir / "last.ckpt")
    again = ["--ckpt_path", ckpt, "--output", str(out / "again"), "--compare_to", str(out / "results")]
    assert (
        main(["evaluate", *tiny_demo_args(tiny_run.root), *again, "--zeroshot", str(out / "colors.jsonl")])
        == 0
    )
    for task in ("zeroshot_retrieval", "zeroshot_classification"):
        comparison = read_results(out / "again", task)["comparison"]
        assert comparison["baseline"]["pretrained"] == ckpt
        for figure in comparison["figures"].values():
            assert {
                key: figure[key] for key in ("difference", "interval", "share_better", "share_worse")
            } == {
                "difference": 0.0,
                "interval": [0.0, 0.0],
                "share_better": 0.0,
                "share_worse": 0.0,
            }
            assert (figure["p_value"], figure["p_holm"], figure["outside_noise"]) == (1.0, 1.0, False)
    assert (
        "Inside the noise (this test set cannot tell the two apart"
        in (out / "again" / "results.md").read_text()
    )


def test_two_scorers_of_the_same_queries_are_paired(
    evaluated: tuple[dict, dict, Path], reranked: Path
) -> None:
    """The matching head's re-ranking against the plain ranking, both of the same captions and images."""
    task = "zeroshot_retrieval"
    plain = read_queries(reranked / queries_file(f"test_{task}.json"), task)
    again = read_queries(reranked / queries_file(f"test+itm_rerank48_{task}.json"), task)
    for key in ("caption_index", "caption_image_id", "image_id"):
        assert np.array_equal(plain[key], again[key])
    differences = paired_differences(
        figures_of(task, again), figures_of(task, plain), Bootstrap(resamples=200)
    )
    assert any(d["difference"] != 0 for d in differences.values())  # the head re-scored every candidate
    for d in differences.values():
        assert d["interval"][0] <= d["difference"] <= d["interval"][1]
        assert d["share_better"] + d["share_worse"] <= 1


def test_comparing_other_queries_or_a_file_that_is_not_data_is_refused(
    evaluated: tuple[dict, dict, Path], tmp_path: Path
) -> None:
    results, _, out = evaluated
    task = "zeroshot_retrieval"
    name = f"test_{task}.json"
    ours = read_queries(out / "results" / queries_file(name), task)
    drawn = Bootstrap(resamples=100)
    add_comparisons({name: dict(results)}, {name: ours}, out / "results", drawn)  # the same queries pair
    fewer = {
        key: value[1:] if key.startswith("caption") or key == "t2i_rank" else value
        for key, value in ours.items()
    }
    with pytest.raises(
        NotComparable, match=r"another test set than this evaluation \(caption_index differs\)"
    ):
        add_comparisons({name: dict(results)}, {name: fewer}, out / "results", drawn)
    elsewhere = {**ours, "source": np.array("0" * 64)}  # the same shape of queries, read from another file
    with pytest.raises(NotComparable, match="the test set's digest differs"):
        add_comparisons({name: dict(results)}, {name: elsewhere}, out / "results", drawn)
    with pytest.raises(NotComparable, match="no other_zeroshot_retrieval.queries.npz there"):
        check_baseline_folder(out / "results", "other_zeroshot_retrieval.json")
    bad = tmp_path / queries_file(name)
    np.savez(bad, **{**ours, "t2i_rank": np.array([object()] * len(ours["t2i_rank"]))})  # pickled objects
    with pytest.raises(NotComparable, match=f"{bad}: not a queries file"):
        read_queries(bad, task)
    for content in (b"", b"PK\x03\x04 not a zip"):
        bad.write_bytes(content)
        with pytest.raises(NotComparable, match=f"{bad}: not a queries file"):
            read_queries(bad, task)


def test_one_test_image_gives_no_interval_rather_than_an_error() -> None:
    one = {
        "caption_index": np.array([0, 1]), "caption_image_id": np.array([7, 7]), "image_id": np.array([7]),
        "t2i_rank": np.array([0, 0]), "i2t_rank": np.array([0]), "source": np.array("0" * 64),
    }  # fmt: skip
    results = {"one_zeroshot_retrieval.json": {"task": "zeroshot_retrieval", "dataset": "one"}}
    add_intervals(results, {"one_zeroshot_retrieval.json": one}, Bootstrap(resamples=10))
    assert results["one_zeroshot_retrieval.json"]["intervals"] is None
