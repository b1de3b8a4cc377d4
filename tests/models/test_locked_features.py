"""LockedImageFeatures: training on cached locked-tower features equals training that recomputes them, and the
cache is keyed by the tower's weights, the transform and the image bytes (each change recomputes what it must)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from mm_lightning.cli import main
from mm_lightning.data import MultimodalDataModule
from mm_lightning.extras import LockedImageFeatures
from mm_lightning.extras.feature_cache import FeatureTable, build_rows, image_key, view_seed
from mm_lightning.models import MultimodalModule
from tests import preloaded
from tests.conftest import DEFAULT_CALLBACKS, LONG_RUN_CALLBACKS, REPO, TinyRun
from tests.data.helpers import TOKENIZER, save_image, write_jsonl
from tests.models.helpers import EXACT_MODEL, gradient_caching, module_kwargs, tiny_config

LOCKED = tiny_config(
    EXACT_MODEL, image={"freeze": True}, image_tower={"image_size": 32}, objective={"itm_weight": 0.0}
)


def _data(root: Path, images: int = 8) -> Path:
    rows = []
    for i in range(images):
        save_image(root / f"{i}.jpg", (40 + 4 * i, 36), seed=i)
        rows.append({"image": f"{i}.jpg", "text": [f"photo {i % 5} of a thing", f"a thing {i % 3}"]})
    write_jsonl(root / "train.jsonl", rows)
    write_jsonl(root / "val.jsonl", rows[:4])
    return root


class CenterCropTraining(MultimodalDataModule):
    """Recomputing reference: the training split read with the evaluation crop, as the cache's view 0 is."""

    def sample_builder(self, split: str, *args: Any, **kwargs: Any) -> Any:
        return super().sample_builder("val" if split == "train" else split, *args, **kwargs)


class Gradients(Callback):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def _fit(
    root: Path, datamodule: type, callbacks: list, model: dict | None = None, batch_size: int = 4
) -> tuple[Gradients, dict]:
    seed_everything(0)
    module = MultimodalModule(**module_kwargs(model or LOCKED))
    dm = datamodule(train_file=str(root / "train.jsonl"), val_file=str(root / "val.jsonl"), tokenizer=TOKENIZER,
                    batch_size=batch_size, max_length=16, image_config=module.data_config["image"])  # fmt: skip
    grads = Gradients()
    trainer = Trainer(
        accelerator="cpu", max_steps=4, deterministic=True, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[grads, *callbacks], default_root_dir=str(root / "run"),
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    return grads, trainer.callback_metrics


def test_training_on_cached_features_equals_recomputing_them(tmp_path: Path) -> None:
    root = _data(tmp_path)
    cache = LockedImageFeatures(cache_dir=str(tmp_path / "cache"), views=0)
    cached, cached_metrics = _fit(root, MultimodalDataModule, [cache])
    # one evaluation-crop row per distinct image; validation (its images among training's, the same crop and
    # tower: the same table) finds its rows there
    assert cache.computed == {"train": 8, "val": 0}
    recomputed, metrics = _fit(root, CenterCropTraining, [])
    assert len(cached.grads) == len(recomputed.grads) == 4
    for a, b in zip(cached.grads, recomputed.grads, strict=True):
        assert a.keys() == b.keys() and not any(k.startswith("model.image_encoder") for k in a)
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(cached_metrics["val/loss"], metrics["val/loss"], rtol=1e-5, atol=1e-6)
    # control: the stock training split (random crops, recomputed) gives other gradients
    random_crops, _ = _fit(root, MultimodalDataModule, [])
    assert any(
        not torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-6)
        for a, b in zip(cached.grads, random_crops.grads, strict=True)
        for n in a
    )


def test_a_restart_reuses_the_cache_and_changes_recompute_what_they_must(tmp_path: Path) -> None:
    root = _data(tmp_path)
    cache_dir = str(tmp_path / "cache")

    def computed(model: dict | None = None, **options: Any) -> dict[str, int]:
        callback = LockedImageFeatures(cache_dir=cache_dir, **options)
        _fit(root, MultimodalDataModule, [callback], model)
        return callback.computed

    assert computed() == {"train": 8, "val": 0}
    assert computed() == {"train": 0, "val": 0}  # a new callback, the same cache folder: nothing recomputed
    save_image(root / "3.jpg", (52, 36), seed=99)  # one image changes
    assert computed() == {"train": 1, "val": 0}
    tower = LOCKED["image_tower"]["init_args"]
    other_weights = tiny_config(LOCKED, image_tower={"kwargs": {**tower["kwargs"], "hidden_dim": 32}})
    assert computed(other_weights) == {"train": 8, "val": 0}
    another_size = tiny_config(LOCKED, image_tower={"image_size": 40})
    assert computed(another_size) == {"train": 8, "val": 0}  # another transform
    assert computed(views=2) == {"train": 16, "val": 0}  # two training crops per image; validation unchanged


def test_view_rows_are_the_tower_on_crops_seeded_by_image_and_view(tmp_path: Path) -> None:
    root = _data(tmp_path, images=3)
    dm = MultimodalDataModule(
        train_file=str(root / "train.jsonl"),
        tokenizer=TOKENIZER,
        images={"size": 32, "train_scale": (0.3, 1.0)},
    )
    dm.setup("fit")
    index = dm.datasets["train"].index
    records = [index.pair(int(r)).record for r in index.first_pair_of_images()]
    builder = dm.sample_builder("train")

    def pixels(record: Any) -> torch.Tensor:
        return dm.normalize(builder(record, "", 0, 0)["image"])

    def encode(images: torch.Tensor) -> torch.Tensor:
        return images.mean(dim=(2, 3))

    table = FeatureTable(tmp_path / "table")
    assert build_rows(records, pixels, encode, table, views=2, seed=5) == 6
    assert build_rows(records, pixels, encode, FeatureTable(tmp_path / "table"), views=2, seed=5) == 0  # kept
    for record in records:
        key = image_key(record)
        rows = [table.get(f"{key}:{v}") for v in range(2)]
        assert not torch.equal(rows[0], rows[1])  # two different random crops
        for view, row in enumerate(rows):
            torch.manual_seed(view_seed(5, key, view))
            torch.testing.assert_close(row, encode(pixels(record)[None])[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"image": {"freeze": False}}, "the image tower trains"),
        ({"objective": {"itm_weight": 1.0}}, "itm_weight 0"),
        (
            {
                "objective": {"itm_weight": 0.0},
                "sample_weighting": {"class_path": "mm_lightning.extras.ComplexityWeighting"},
            },
            "ComplexityWeighting reads the images' pixels",
        ),
    ],
)
def test_refused_where_features_would_be_stale_or_missing(
    tmp_path: Path, overrides: dict, message: str
) -> None:
    root = _data(tmp_path, images=4)
    with pytest.raises(ValueError, match=message):
        _fit(
            root,
            MultimodalDataModule,
            [LockedImageFeatures(str(tmp_path / "cache"))],
            tiny_config(LOCKED, **overrides),
        )


def test_a_bad_image_is_named_or_skipped_and_counted(tmp_path: Path) -> None:
    from mm_lightning.data import RecordError

    root = _data(tmp_path)
    (root / "5.jpg").write_text("<html>not found</html>")
    with pytest.raises(RecordError, match=r"train\.jsonl:6 .*5\.jpg"):
        _fit(root, MultimodalDataModule, [LockedImageFeatures(str(tmp_path / "cache"))])

    class Skipping(MultimodalDataModule):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(on_bad_record="skip", **kwargs)

    callback = LockedImageFeatures(str(tmp_path / "cache"))
    _, metrics = _fit(root, Skipping, [callback])
    assert callback.computed == {
        "train": 7,
        "val": 0,
    }  # the bad image has no row; a valid one stands in for it
    assert torch.isfinite(metrics["val/loss"])


def test_cached_features_with_gradient_caching_see_the_whole_batch(tmp_path: Path) -> None:
    # Large effective batches for LiT: the text tower in chunks, every caption of the batch a negative of every
    # image, exactly as one forward of the whole batch.
    root = _data(tmp_path)

    def run(chunks: int) -> Gradients:
        callback = LockedImageFeatures(str(tmp_path / "cache"))
        return _fit(
            root,
            MultimodalDataModule,
            [callback],
            tiny_config(LOCKED, batch_embedding=gradient_caching(chunks)),
        )[0]

    whole, chunked = run(1), run(2)
    for a, b in zip(whole.grads, chunked.grads, strict=True):
        for name in a:  # to float rounding of sums (4e-6 on embedding gradients up to 11), as on pixels
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)
    # control: without the large batch (two forward batches of half the size) the gradients differ
    halves = _fit(root, MultimodalDataModule, [LockedImageFeatures(str(tmp_path / "cache"))],
                  tiny_config(LOCKED), batch_size=2)[0]  # fmt: skip
    assert not torch.allclose(
        whole.grads[0]["model.image_proj.weight"], halves.grads[0]["model.image_proj.weight"]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_compute_a_share_each_and_a_restart_none(tmp_path: Path) -> None:
    import json
    import sys

    from mm_lightning.cli import main
    from tests.conftest import tiny_demo_args

    extra = tmp_path / "cache.yaml"
    extra.write_text(
        "trainer:\n  callbacks:\n    - class_path: mm_lightning.extras.LockedImageFeatures\n"
        f"      init_args: {{cache_dir: {tmp_path / 'cache'}}}\n"
    )

    def args(run: str) -> list[str]:
        return [
            *tiny_demo_args(tmp_path / run, max_steps=3),
            "--data.init_args.data_dir", str(tmp_path / "demo"),
            "--model.image.freeze", "true", "--model.objective.itm_weight", "0",
            "--trainer.accelerator", "cpu", "--config", str(extra),
        ]  # fmt: skip

    def parts() -> dict[str, list[str]]:
        return {p.name: json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*/part-*.json")}

    two = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    done = preloaded.run([sys.executable, "-m", "mm_lightning", "fit", *args("first"), *two], capture_output=True,
                         timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    first = parts()
    writers = {name.split("-")[1] for name in first}
    assert writers == {"r0", "r1"}  # each rank computed its share
    keys = [k for rows in first.values() for k in rows]
    assert len(keys) == len(set(keys)) > 0  # no row computed twice
    assert main(["fit", *args("second")]) == 0  # one process finds every row the two computed
    assert parts() == first  # a restart computes nothing


def test_the_cache_refuses_a_run_without_a_jsonl_data_module() -> None:
    with pytest.raises(ValueError, match="this run has no data module"):
        LockedImageFeatures().serve(SimpleNamespace(datamodule=None), None, "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="this run has a SimpleNamespace"):
        LockedImageFeatures().serve(SimpleNamespace(datamodule=SimpleNamespace()), None, "fit")  # type: ignore[arg-type]


def test_lit_on_the_shards_its_config_writes_says_how_to_train(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/data.md's shard command on configs/lit.yaml, then LiT on those shards: one line with the fix."""
    demo = tiny_run.root / "demo"
    files = ["--data.init_args.train_file", str(demo / "train.jsonl"), "--data.init_args.val_file",
             str(demo / "val.jsonl"), "--data.init_args.test_file", "null"]  # fmt: skip
    shards = tmp_path / "shards"
    lit = ["--config", str(REPO / "configs" / "lit.yaml")]
    assert main(["shard", *lit, *files, "--out", str(shards), "--progress", "false", "--workers", "1"]) == 0
    fit = [
        "fit", *lit, "--data.class_path", "mm_lightning.extras.ShardDataModule",
        "--data.init_args.train_shards", str(shards / "train" / "shards.json"),
        "--data.init_args.val_shards", str(shards / "val" / "shards.json"),
        "--data.init_args.batch_size", "16", "--data.init_args.num_workers", "0",
        "--model.image_tower.init_args.image_size", "32", "--trainer.max_steps", "1",
        "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    assert main(fit) == 1
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.startswith(
        "error: FeatureCacheError: LockedImageFeatures: precomputed image features replace the images of JSONL splits"
    )
    fix = "--trainer.callbacks mm_lightning/callbacks/default.yaml --trainer.callbacks+ configs/callbacks/long_run.yaml"
    assert fix in line and "Traceback" not in err
    # control: the fix it names trains LiT on the shards
    assert (
        main(
            [
                *fit[:-2],
                "--trainer.default_root_dir",
                str(tmp_path / "run2"),
                "--trainer.callbacks",
                str(DEFAULT_CALLBACKS),
                "--trainer.callbacks+",
                str(LONG_RUN_CALLBACKS),
            ]
        )
        == 0  # fmt: skip
    )
