"""SigLIP and gradient caching on 2 gloo processes equal the single-process computation on the whole batch."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.largebatch import workers
from tests.largebatch.lightning_helpers import max_param_diff
from tests.largebatch.toy import max_diff

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("largebatch_dist")
    mp.spawn(workers.worker, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _siglip_errors(results: list[dict], case: str) -> dict[str, float]:
    """Max abs deviation from the single-process value, relative to that value's size when it exceeds 1."""
    ref = results[0]["refs"]["siglip"]
    err = dict.fromkeys(["loss", "img", "txt", "scale", "bias"], 0.0)
    for res in results:
        got = res[case]
        lo, hi = got["rows"].tolist()
        for key in err:
            want = ref[key][lo:hi] if key in ("img", "txt") else ref[key]
            size = max(1.0, want.abs().max().item())
            err[key] = max(err[key], (got[key] - want).abs().max().item() / size)
    return err


def test_siglip_ring_exchange_is_exact(results: list[dict]) -> None:
    errors = _siglip_errors(results, "siglip")
    print("SigLIP distributed vs single-process max abs errors:", errors)
    assert all(e < 1e-6 for e in errors.values()), errors
    assert results[0]["siglip"]["txt"].abs().max() > 1e-3  # not trivially zero


def test_siglip_controls_differ(results: list[dict]) -> None:
    # an exchange without gradient loses the other ranks' terms of the caption gradient
    no_grad = _siglip_errors(results, "siglip_no_grad_exchange")
    assert no_grad["loss"] < 1e-6 and no_grad["txt"] > 1e-3, no_grad
    # local negatives only: another loss
    assert _siglip_errors(results, "siglip_local")["loss"] > 1e-2


def test_gradient_caching_under_ddp_equals_single_process_full_batch(results: list[dict]) -> None:
    want = results[0]["refs"]["gradcache"]
    for res in results:
        error = max_diff(res["gradcache_ddp"], want)
        print(f"gradient caching under DDP: max abs gradient error {error:.2e}")
        assert error < 1e-6
    # control: letting DDP's hooks run on every chunk reduces a partial gradient and then adds local ones
    assert max(max_diff(res["gradcache_ddp_hooks_every_chunk"], want) for res in results) > 1e-4


@pytest.mark.parametrize("strategy", ["ddp", "ddp_explicit"])
def test_module_step_with_chunks_on_two_ranks_equals_one_process(results: list[dict], strategy: str) -> None:
    want = results[0]["refs"]["module"]
    for rank, res in enumerate(results):
        difference = max_param_diff(res[f"module_{strategy}"], want)
        print(f"{strategy}, 2 ranks x 4 chunks vs 1 process whole batch, rank {rank}: {difference:.2e}")
        assert difference <= 1e-5
