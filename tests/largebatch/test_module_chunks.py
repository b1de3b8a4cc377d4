"""MultimodalModule with ``loss.chunks``: one Lightning step with 4 chunks equals one step on the whole batch."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from tests.largebatch.lightning_helpers import Rows, SGDModule, fit_one_step, max_param_diff
from tests.models.helpers import EXACT_MODEL, tiny_config

pytestmark = pytest.mark.slow
BATCH, CHUNKS = 16, 4


def _module(chunks: int, loss: dict | None = None) -> SGDModule:
    torch.manual_seed(0)
    return SGDModule(**tiny_config(EXACT_MODEL, loss={"chunks": chunks} | (loss or {})))


def test_four_chunks_equal_the_whole_batch_and_accumulation_does_not() -> None:
    torch.manual_seed(1)  # the ITM head's hard negatives are drawn from the same generator state
    full = fit_one_step(_module(1), DataLoader(Rows(BATCH), batch_size=BATCH))
    torch.manual_seed(1)
    chunked = fit_one_step(_module(CHUNKS), DataLoader(Rows(BATCH), batch_size=BATCH))
    difference = max_param_diff(chunked, full)
    print(f"4 chunks vs whole batch: max parameter difference {difference:.2e}")
    assert difference <= 1e-5
    # the step moved the towers, the ITM head and the temperature
    initial = {n: p.detach() for n, p in _module(1).named_parameters()}
    for name in ("image_encoder", "text_encoder", "itm.head", "contrastive.logit_scale"):
        assert (
            max_param_diff(*({n: v for n, v in d.items() if n.startswith(name)} for d in (full, initial)))
            > 1e-3
        )

    # control: Lightning's gradient accumulation over 4 micro-batches of 4 is another update
    torch.manual_seed(1)
    accumulated = fit_one_step(_module(1), DataLoader(Rows(BATCH), batch_size=BATCH // CHUNKS), CHUNKS)
    assert max_param_diff(accumulated, full) > 1e-3


def test_chunks_under_a_gradient_scaler_and_with_siglip() -> None:
    """fp16 autocast with a GradScaler: the cached gradients carry the scaler's scale; SigLIP: any pair loss."""
    # a scale that does not overflow on the first step, so both runs take it
    scaler = {
        "plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))]
    }
    siglip = {"itm_weight": 0.0, "name": "siglip"}
    full = fit_one_step(_module(1, siglip), DataLoader(Rows(BATCH), batch_size=BATCH))
    chunked = fit_one_step(_module(CHUNKS, siglip), DataLoader(Rows(BATCH), batch_size=BATCH))
    assert max_param_diff(chunked, full) <= 1e-5
    no_itm = {"itm_weight": 0.0}
    full = fit_one_step(_module(1, no_itm), DataLoader(Rows(BATCH), batch_size=BATCH), **scaler)
    chunked = fit_one_step(_module(CHUNKS, no_itm), DataLoader(Rows(BATCH), batch_size=BATCH), **scaler)
    initial = {n: p.detach() for n, p in _module(1, no_itm).named_parameters()}
    assert max_param_diff(full, initial) > 1e-2  # the step was taken, not skipped for inf gradients
    # fp16 rounding differs between the two layouts; a scale error would be 256 times off
    print(
        f"fp16 + GradScaler, 4 chunks vs whole batch: max parameter difference {max_param_diff(chunked, full):.2e}"
    )
    assert max_param_diff(chunked, full) < 1e-2


def test_bad_chunks_are_refused() -> None:
    with pytest.raises(ValueError, match="loss.chunks must be >= 1"):
        _module(0)
