"""Streaming from a real local object store (moto's S3 server) and a real HTTP server, through the CLI."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mm_lightning.data.transforms import eval_transform
from mm_lightning.extras.shards.files import list_shards
from tests import preloaded
from tests.shards.helpers import shard_dataset, shard_demo_args, uneven_shards
from tests.shards.servers import CREDENTIALS, http_server, s3_server, upload


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)


def test_s3_http_and_pipe_read_the_same_samples_as_local(
    tmp_path: Path, s3_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pattern = uneven_shards(tmp_path / "local", sizes=(4, 2, 3))
    local = shard_dataset(pattern, eval_transform(32), caption_sampling="all")
    expected = [(s["caption"], s["image"]) for s in (local[i] for i in range(len(local)))]
    with s3_server() as endpoint, http_server(tmp_path) as base:
        upload(endpoint, "bucket", tmp_path / "local", "data")
        options = {"s3": {"endpoint_url": endpoint}}  # keyed by protocol: http gets none
        pipe = [f"pipe:cat {tmp_path}/local/{i:05d}.tar" for i in range(3)]
        for spec in ("s3://bucket/data/{00000..00002}.tar", f"{base}/local/{{00000..00002}}.tar", pipe):
            shards = list_shards(spec, options, str(tmp_path / "cache"))
            assert [s.nsamples for s in shards] == [4, 2, 3], spec
            remote = shard_dataset(
                spec, eval_transform(32), caption_sampling="all", storage_options=options,
                cache_dir=str(tmp_path / "cache"), open_shards=1,
            )  # fmt: skip
            got = [(s["caption"], s["image"]) for s in (remote[i] for i in range(len(remote)))]
            assert [c for c, _ in got] == [c for c, _ in expected], spec
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True)), spec
            remote.cache.close()
            assert not [
                f for f in os.listdir(tmp_path / "cache") if f.endswith(".tar")
            ]  # evicted copies removed
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the endpoint from the environment instead
        assert [s.nsamples for s in list_shards("s3://bucket/data/{00000..00002}.tar")] == [4, 2, 3]
        with pytest.raises(Exception, match="00003.tar"):
            list_shards("s3://bucket/data/{00000..00003}.tar", {"endpoint_url": endpoint})  # flat form


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_processes_train_from_s3_with_uneven_shards_and_validate_over_http(
    tmp_path: Path, s3_env: None
) -> None:
    from mm_lightning.extras import DemoShardDataModule

    demo = tmp_path / "demo"
    shard_args = {"render_size": 32, "train_renders": 1, "num_val": 24, "num_test": 24}
    DemoShardDataModule(str(demo), samples_per_shard=300, **shard_args).prepare_data()  # 300, 300, 300, 132
    with s3_server() as endpoint, http_server(demo / "shards") as base:
        upload(endpoint, "bucket", demo / "shards" / "train", "train")
        args = [
            *shard_demo_args(tmp_path, max_steps=-1),
            "--data.init_args.data_dir", str(demo),
            "--data.init_args.samples_per_shard", "300",
            "--data.init_args.train_shards", "s3://bucket/train/{00000..00003}.tar",
            "--data.init_args.storage_options", f'{{"s3": {{"endpoint_url": "{endpoint}"}}}}',
            "--data.init_args.cache_dir", str(tmp_path / "cache"),
            "--data.init_args.val_shards", f"{base}/val/shards.json",
            "--data.init_args.num_workers", "1",
            "--data.init_args.batch_size", "32",
            "--trainer.val_check_interval", "1.0",
            "--trainer.limit_val_batches", "2",
            "--trainer.devices", "2",
            "--trainer.strategy", "ddp",
        ]  # fmt: skip
        proc = preloaded.run(
            [sys.executable, "-m", "mm_lightning", "fit", *args], capture_output=True, timeout=360
        )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    # 1032 samples / 2 ranks = 516 each -> 16 full batches of 32 on both ranks (no rank waits for the other).
    assert checkpoint["global_step"] == 16 and checkpoint["epoch"] == 1  # written when training ended
    assert list(
        (tmp_path / "checkpoints").glob("best-*.ckpt")
    )  # val/r1_t2i was computed from the HTTP shards
    # The demo shards the run trained from are uneven: 300, 300, 300, 132.
    listing = json.loads((demo / "shards" / "train" / "shards.json").read_text())
    assert [s["nsamples"] for s in listing["shardlist"]] == [300, 300, 300, 132]
