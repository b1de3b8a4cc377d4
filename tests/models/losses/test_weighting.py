"""Loss weighting: Dynamic Weight Averaging and per-pair complexity weights."""

from __future__ import annotations

import pytest
import torch

from mm_lightning.models import DynamicWeightAveraging
from mm_lightning.models.losses import complexity_weights


def test_dwa_keeps_base_weights_then_favours_the_slower_loss() -> None:
    dwa = DynamicWeightAveraging([1.0, 0.5], window=2, temperature=2.0)
    # window 1 sets the reference; window 2 has the same means -> equal ratios -> still the base weights
    for _ in range(4):
        torch.testing.assert_close(dwa.update(torch.tensor([1.0, 1.0])), torch.tensor([1.0, 0.5]))
    for _ in range(2):  # loss 0 halves, loss 1 stays flat
        weights = dwa.update(torch.tensor([0.5, 1.0]))
    ratios = torch.tensor([0.5, 1.0])
    want = torch.tensor([1.0, 0.5]) * 2 * torch.softmax(ratios / 2.0, 0)
    torch.testing.assert_close(weights, want)
    assert weights[1] / 0.5 > weights[0] / 1.0  # the stalled loss gained relative weight
    state = dwa.state_dict()
    assert {"weights", "previous_mean", "window_sum"} <= set(state)
    assert int(state["windows_done"]) == 3


def test_complexity_weights_favour_busy_images_and_long_captions() -> None:
    images = torch.zeros(3, 3, 8, 8)
    images[1] = torch.randn(3, 8, 8)  # busy image
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    w = complexity_weights(images, mask)
    assert w.mean().item() == pytest.approx(1.0)
    assert w[1] > w[0] and w[2] > w[0]
