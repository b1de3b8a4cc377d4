"""Loss weighting rules: Dynamic Weight Averaging of the loss terms and per-pair complexity weights."""

from __future__ import annotations

import pytest
import torch

from mm_lightning.extras import DynamicWeightAveraging
from mm_lightning.extras.loss_weighting import complexity_weights

FIXED = {"itc": 1.0, "itm": 0.5, "uniformity": 0.1}


def terms(itc: float, itm: float) -> dict[str, torch.Tensor]:
    return {"itc": torch.tensor(itc), "itm": torch.tensor(itm), "uniformity": torch.tensor(3.0)}


def test_dwa_keeps_the_fixed_weights_then_favours_the_slower_loss() -> None:
    dwa = DynamicWeightAveraging(window=2, temperature=2.0)
    # window 1 sets the reference; window 2 has the same means -> equal ratios -> still the fixed weights
    for _ in range(4):
        weights = dwa(terms(1.0, 1.0), FIXED)
        torch.testing.assert_close(torch.stack([weights["itc"], weights["itm"]]), torch.tensor([1.0, 0.5]))
    for _ in range(2):  # the itc loss halves, the itm loss stays flat
        weights = dwa(terms(0.5, 1.0), FIXED)
    want = torch.tensor([1.0, 0.5]) * 2 * torch.softmax(torch.tensor([0.5, 1.0]) / 2.0, 0)
    torch.testing.assert_close(torch.stack([weights["itc"], weights["itm"]]), want)
    assert weights["itm"] / 0.5 > weights["itc"] / 1.0  # the stalled loss gained relative weight
    assert weights["uniformity"] == 0.1  # a loss's other terms keep their fixed weights
    state = dwa.state_dict()
    assert {"factors", "previous_mean", "window_sum"} <= set(state)
    assert int(state["windows_done"]) == 3


def test_complexity_weights_favour_busy_images_and_long_captions() -> None:
    images = torch.zeros(3, 3, 8, 8)
    images[1] = torch.randn(3, 8, 8)  # busy image
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    w = complexity_weights(images, mask)
    assert w.mean().item() == pytest.approx(1.0)
    assert w[1] > w[0] and w[2] > w[0]
