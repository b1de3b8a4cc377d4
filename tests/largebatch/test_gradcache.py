"""Gradient caching on one process: exact full-batch gradients, replayed randomness, BatchNorm statistics."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from mm_lightning.extras import gradient_caching as gradcache
from mm_lightning.extras.gradient_caching import GradientCache, split_batch
from tests.largebatch.toy import ToyModel, grads, max_diff, toy_batch

BATCH, CHUNKS = 16, 4


def _pair(**kwargs) -> tuple[ToyModel, ToyModel]:
    torch.manual_seed(0)
    full = ToyModel(chunks=1, **kwargs)
    chunked = ToyModel(chunks=CHUNKS, **kwargs)
    chunked.load_state_dict(full.state_dict())
    return full, chunked


def _step(model: ToyModel, batch: dict, seed: int = 0) -> float:
    torch.manual_seed(seed)
    loss = model(batch)
    model.backward(loss)
    return loss.item()


def test_chunked_gradients_equal_full_batch_and_accumulation_does_not() -> None:
    full, chunked = _pair()
    batch = toy_batch(BATCH)
    loss_full, loss_chunked = _step(full, batch), _step(chunked, batch)
    want, got = grads(full), grads(chunked)
    assert loss_chunked == pytest.approx(loss_full, abs=1e-6)
    # every parameter, the temperature (counted once) included
    assert "loss.logit_scale" in got and got["loss.logit_scale"].abs() > 1e-4
    assert max_diff(got, want) < 1e-6

    # control: plain accumulation of 4 micro-batches (each with only its own negatives) is another gradient
    accumulated, _ = _pair()
    accumulated.load_state_dict(full.state_dict())
    for part in split_batch(batch, CHUNKS):
        (accumulated(part) / CHUNKS).backward()
    assert max_diff(grads(accumulated), want) > 1e-3


def test_uneven_chunks_and_fewer_rows_than_chunks() -> None:
    parts = split_batch({"x": torch.arange(10), "name": "kept", "scalar": torch.tensor(3.0)}, 4)
    assert [len(p["x"]) for p in parts] == [3, 3, 2, 2]
    assert all(p["name"] == "kept" and p["scalar"] == 3.0 for p in parts)
    assert len(split_batch({"x": torch.arange(3)}, 4)) == 3

    full, chunked = _pair()
    batch = toy_batch(10)
    _step(full, batch)
    _step(chunked, batch)
    assert max_diff(grads(chunked), grads(full)) < 1e-6


def _chunkwise_reference(model: ToyModel, batch: dict, seed: int) -> dict:
    """The exact gradient of the chunked-dropout objective: every chunk embedded with graph, in pass-1 order."""
    torch.manual_seed(seed)
    outs = [model.towers(part) for part in split_batch(batch, CHUNKS)]
    image = torch.cat([o["image"] for o in outs])
    text = torch.cat([o["text"] for o in outs])
    model.loss(model.head(image), model.head(text), batch["image_id"]).backward()
    return grads(model)


def test_dropout_masks_are_replayed_in_pass_two(monkeypatch: pytest.MonkeyPatch) -> None:
    full, chunked = _pair(dropout=0.3)
    batch = toy_batch(BATCH)
    want = _chunkwise_reference(full, batch, seed=5)
    rng_after_step = None
    _step(chunked, batch, seed=5)
    rng_after_step = torch.get_rng_state()
    assert max_diff(grads(chunked), want) < 1e-6
    # pass 2 leaves the caller's generator where pass 1 left it
    torch.manual_seed(5)
    for part in split_batch(batch, CHUNKS):
        chunked.towers(part)
    assert torch.equal(torch.get_rng_state(), rng_after_step)

    # control: without the replay, pass 2 draws new masks and the gradient is wrong
    monkeypatch.setattr(gradcache._RandomState, "replayed", lambda self: contextlib.nullcontext())
    chunked.zero_grad(set_to_none=True)
    _step(chunked, batch, seed=5)
    assert max_diff(grads(chunked), want) > 1e-3


def test_batchnorm_statistics_are_updated_once_per_chunk() -> None:
    full, chunked = _pair(batch_norm=True)
    batch = toy_batch(BATCH)
    for part in split_batch(batch, CHUNKS):  # what the statistics should be: one update per chunk
        full.towers(part)
    _step(chunked, batch)
    bn_full, bn_chunked = full.towers.image[1], chunked.towers.image[1]
    assert int(bn_chunked.num_batches_tracked) == CHUNKS
    torch.testing.assert_close(bn_chunked.running_mean, bn_full.running_mean)
    torch.testing.assert_close(bn_chunked.running_var, bn_full.running_var)


def test_autocast_is_re_entered_in_pass_two() -> None:
    full, chunked = _pair()
    batch = toy_batch(BATCH)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked.cache.embed(chunked.towers, batch)
        assert out["image"].dtype == torch.bfloat16
        loss = chunked.loss(chunked.head(out["image"]), chunked.head(out["text"]), batch["image_id"])
    chunked.cache.backward(loss)  # outside autocast, as Lightning's backward is
    _step(full, batch)
    got, want = grads(chunked), grads(full)
    # bf16 rounding only (a pass 2 in fp32 would fail on the dtype of the cached gradients)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0.1, atol=2e-2, msg=name)


def test_backward_without_embed_and_bad_chunks_are_errors() -> None:
    with pytest.raises(ValueError, match="chunks >= 1"):
        GradientCache(torch.nn.Linear(1, 1), 0)
    cache = GradientCache(torch.nn.Linear(1, 1), 2)
    with pytest.raises(RuntimeError, match="without a preceding embed"):
        cache.backward(torch.zeros((), requires_grad=True))


def test_strategies_that_cannot_run_gradient_caching_are_refused() -> None:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from mm_lightning.extras import ExplicitAllReduceDDPStrategy

    gradcache.check_strategy(DDPStrategy())
    gradcache.check_strategy(ExplicitAllReduceDDPStrategy())
    # once DDP wraps the model: its options as DistributedDataParallel keeps them
    gradcache.check_ddp_wrapper(SimpleNamespace(find_unused_parameters=False, static_graph=False))
    gradcache.check_ddp_wrapper(torch.nn.Linear(1, 1))  # not wrapped (one process, ddp_explicit)
    with pytest.raises(ValueError, match="find_unused_parameters=False"):
        gradcache.check_ddp_wrapper(SimpleNamespace(find_unused_parameters=True, static_graph=False))
    with pytest.raises(ValueError, match="static_graph=False"):
        gradcache.check_ddp_wrapper(SimpleNamespace(find_unused_parameters=False, static_graph=True))
    with pytest.raises(ValueError, match="sharded strategy FSDPStrategy"):
        gradcache.check_strategy(FSDPStrategy())
