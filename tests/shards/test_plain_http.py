"""Shards from ``python -m http.server``, a server that ignores ``Range`` (as many proxies and presigned URLs do)."""

from __future__ import annotations

import sys
from pathlib import Path

import fsspec
import pytest
import torch

from mm_lightning.data.transforms import eval_transform
from mm_lightning.extras.shards.files import ShardError, list_shards
from tests import preloaded
from tests.shards.helpers import large_jpeg_bytes, shard_dataset, shard_demo_args, uneven_shards, write_shard
from tests.shards.servers import plain_http_server

FSSPEC_BLOCK = 5 * 2**20  # fsspec's default HTTP block size: a ranged reader asks for more past this


def shards_with_a_large_one(root: Path) -> str:
    """Shards 00000..00002 (the middle one larger than one fsspec block); returns the brace pattern."""
    pattern = uneven_shards(root, sizes=(3, 2, 4))
    write_shard(root / "00001.tar", 3, 2, broken={4: large_jpeg_bytes()})  # a big photo, not a broken one
    assert (root / "00001.tar").stat().st_size > FSSPEC_BLOCK
    return pattern


def test_shards_larger_than_a_block_read_without_range_requests(tmp_path: Path) -> None:
    pattern = shards_with_a_large_one(tmp_path / "shards")
    local = shard_dataset(pattern, eval_transform(32), caption_sampling="all")
    expected = [(s["caption"], s["image"]) for s in (local[i] for i in range(len(local)))]
    with plain_http_server(tmp_path / "shards") as base:
        # Control: fsspec's random-access file needs ranges past its first block, which this server ignores.
        with pytest.raises(ValueError, match="range requests"), fsspec.open(f"{base}/00001.tar", "rb") as f:
            while f.read(1 << 20):
                pass
        spec = f"{base}/{{00000..00002}}.tar"
        cache = str(tmp_path / "cache")
        assert [s.nsamples for s in list_shards(spec, cache_dir=cache)] == [3, 2, 4]
        remote = shard_dataset(
            spec, eval_transform(32), caption_sampling="all", cache_dir=cache, open_shards=1
        )
        got = [(s["caption"], s["image"]) for s in (remote[i] for i in range(len(remote)))]
        remote.cache.close()
    assert [c for c, _ in got] == [c for c, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))


def test_a_page_that_is_not_a_tar_is_named_with_what_was_received(tmp_path: Path) -> None:
    root = tmp_path / "site"
    root.mkdir()
    # What a login page, a proxy's error page or an expired presigned URL sends back with status 200.
    (root / "00000.tar").write_text("<!DOCTYPE html><html><body>Please sign in</body></html>\n")
    with plain_http_server(root) as base, pytest.raises(ShardError) as caught:
        list_shards(
            f"{base}/00000.tar", cache_dir=str(tmp_path / "cache")
        )  # no stats file: indexes the shard
    message = str(caught.value)
    assert f"{base}/00000.tar" in message and "not a tar file" in message, message
    assert "got 56 bytes, starting '<!DOCTYPE html><html><body>Please sign in" in message, message
    with plain_http_server(root) as base, pytest.raises(ShardError, match="not found"):
        list_shards(f"{base}/00001.tar", cache_dir=str(tmp_path / "cache"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_processes_train_from_a_plain_http_server(tmp_path: Path) -> None:
    """The user's steps: ``python -m http.server`` in a folder of shards, ``train_shards`` as an http brace pattern."""
    shards_with_a_large_one(tmp_path / "served")
    args = [
        *shard_demo_args(tmp_path, max_steps=2),
        "--data.init_args.data_dir", str(tmp_path / "demo"),  # the demo's val/test shards, generated
        "--data.init_args.cache_dir", str(tmp_path / "cache"),
        "--data.init_args.batch_size", "2",
        "--trainer.limit_val_batches", "0",
        "--trainer.devices", "2",
        "--trainer.strategy", "ddp",
    ]  # fmt: skip
    with plain_http_server(tmp_path / "served") as base:
        args += ["--data.init_args.train_shards", f"{base}/{{00000..00002}}.tar"]
        proc = preloaded.run(
            [sys.executable, "-m", "mm_lightning", "fit", *args], capture_output=True, timeout=360
        )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2
