"""MultimodalModule with ``batch_embedding: GradientCaching``: one Lightning step with 4 chunks equals one step on the whole batch."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from mm_lightning.extras import GradientCaching
from tests.largebatch.lightning_helpers import Rows, SGDModule, fit_one_step, max_param_diff
from tests.models.helpers import EXACT_MODEL, TINY_MODEL, gradient_caching, tiny_kwargs

pytestmark = pytest.mark.slow
BATCH, CHUNKS = 16, 4
# SigLIP as ``loss.name: siglip`` built it before (temperature_init 0.07, not SigLipLoss's own 0.1)
SIGLIP = {"class_path": "mm_lightning.models.losses.SigLipLoss", "init_args": {"temperature_init": 0.07}}


def _module(chunks: int, objective: dict | None = None, loss: dict | None = None) -> SGDModule:
    torch.manual_seed(0)
    parts = {} if loss is None else {"loss": loss}
    return SGDModule(
        **tiny_kwargs(
            EXACT_MODEL, batch_embedding=gradient_caching(chunks), objective=objective or {}, **parts
        )
    )


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
    for name in (
        "model.image_encoder",
        "model.text_encoder",
        "model.itm.head",
        "model.contrastive.logit_scale",
    ):
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
    no_itm = {"itm_weight": 0.0}
    full = fit_one_step(_module(1, no_itm, SIGLIP), DataLoader(Rows(BATCH), batch_size=BATCH))
    chunked = fit_one_step(_module(CHUNKS, no_itm, SIGLIP), DataLoader(Rows(BATCH), batch_size=BATCH))
    assert max_param_diff(chunked, full) <= 1e-5
    full = fit_one_step(_module(1, no_itm), DataLoader(Rows(BATCH), batch_size=BATCH), **scaler)
    chunked = fit_one_step(_module(CHUNKS, no_itm), DataLoader(Rows(BATCH), batch_size=BATCH), **scaler)
    initial = {n: p.detach() for n, p in _module(1, no_itm).named_parameters()}
    assert max_param_diff(full, initial) > 1e-2  # the step was taken, not skipped for inf gradients
    # fp16 rounding differs between the two layouts; a scale error would be 256 times off
    print(
        f"fp16 + GradScaler, 4 chunks vs whole batch: max parameter difference {max_param_diff(chunked, full):.2e}"
    )
    assert max_param_diff(chunked, full) < 1e-2


@pytest.mark.parametrize("chunks", [0, 1])
def test_bad_chunks_are_refused(chunks: int) -> None:
    with pytest.raises(ValueError, match=r"GradientCaching needs chunks >= 2 \(1 is the whole batch"):
        GradientCaching(chunks)


def test_batchnorm_tower_is_named_at_fit_start_and_freeze_batchnorm_makes_it_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A BatchNorm image tower (the demo's ResNet) normalizes per chunk: the run warns, naming the layers, and
    ``freeze_batchnorm`` (BatchNorm on its running statistics) makes the chunked step the whole batch's."""
    no_dropout = {
        "text_tower": EXACT_MODEL["text_tower"]
    }  # the text tower without dropout: BatchNorm is the only difference

    def step(chunks: int, **image: object) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        module = SGDModule(
            **tiny_kwargs(TINY_MODEL, batch_embedding=gradient_caching(chunks), image=image, **no_dropout)
        )
        torch.manual_seed(1)
        return fit_one_step(module, DataLoader(Rows(BATCH), batch_size=BATCH))

    full = step(1)
    with pytest.warns(
        UserWarning, match=r"6 BatchNorm layer\(s\) in training mode \(image_encoder\."
    ) as caught:
        chunked = step(CHUNKS)
    message = next(str(w.message) for w in caught if "BatchNorm" in str(w.message))
    assert "freeze_batchnorm" in message and "GroupNorm" in message
    print(
        f"BatchNorm tower, 4 chunks vs whole batch: max parameter difference {max_param_diff(chunked, full):.2e}"
    )
    assert max_param_diff(chunked, full) > 1e-3  # control: per-chunk statistics give another step

    full = step(1, freeze_batchnorm=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*BatchNorm")
        chunked = step(CHUNKS, freeze_batchnorm=True)
    assert max_param_diff(chunked, full) <= 1e-5
    torch.manual_seed(0)
    initial = SGDModule(**tiny_kwargs(TINY_MODEL, image={"freeze_batchnorm": True}, **no_dropout))
    image = {n: p.detach() for n, p in initial.named_parameters() if n.startswith("model.image_encoder")}
    assert max_param_diff(image, full) > 1e-3  # the BatchNorm tower (affine weights included) still trained


def test_dropout_under_chunks_is_noted(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    module = SGDModule(
        **tiny_kwargs(EXACT_MODEL, batch_embedding=gradient_caching(2), text_tower=TINY_MODEL["text_tower"])
    )  # dropout 0.1
    with caplog.at_level(logging.INFO):
        fit_one_step(module, DataLoader(Rows(BATCH), batch_size=BATCH))
    notes = [r.getMessage() for r in caplog.records if "dropout in" in r.getMessage()]
    assert len(notes) == 1 and "text_encoder." in notes[0] and "in distribution" in notes[0], notes
