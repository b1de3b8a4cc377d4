"""ContrastiveLoss (single process), hard-negative sampling, Dynamic Weight Averaging."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mm_lightning.models import ContrastiveLoss, DynamicWeightAveraging
from mm_lightning.models.losses import sample_hard_negatives


def clip_reference(img: torch.Tensor, txt: torch.Tensor, scale: float) -> torch.Tensor:
    logits = scale * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
    targets = torch.arange(len(img))
    return 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets))


def test_matches_clip_formula_and_temperature_init() -> None:
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g) * 3  # scale must not matter
    loss_fn = ContrastiveLoss(temperature_init=0.07)
    assert loss_fn.temperature.item() == pytest.approx(0.07)
    torch.testing.assert_close(loss_fn(img, txt), clip_reference(img, txt, 1 / 0.07))


def test_logit_scale_is_clamped_at_100() -> None:
    loss_fn = ContrastiveLoss(temperature_init=0.001)  # logit scale 1000 -> clamped
    assert loss_fn.scale().item() == pytest.approx(100.0)
    img, txt = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(loss_fn(img, txt), clip_reference(img, txt, 100.0))


def test_pairs_sharing_an_image_are_not_negatives() -> None:
    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    ids = torch.tensor([0, 0, 1, 2, 2])
    got = ContrastiveLoss()(img, txt, ids)
    # reference: drop same-image columns other than the pair itself, row by row
    logits = (1 / 0.07) * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
    want = 0.0
    for i in range(5):
        keep = (ids != ids[i]) | (torch.arange(5) == i)
        for row in (logits[i], logits[:, i]):
            want += -torch.log_softmax(row[keep], 0)[keep[: i + 1].sum() - 1]
    torch.testing.assert_close(got, want / 10)
    # control: without ids the other caption of the same image is a negative
    assert (ContrastiveLoss()(img, txt) - got).abs() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_math_under_autocast(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    img, txt = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    loss_fn = ContrastiveLoss()
    want = loss_fn(img, txt)
    with torch.autocast("cpu", dtype=dtype):
        logits, _, _ = loss_fn.logits(img, txt)
        got = loss_fn(img, txt)
        control = clip_reference(img, txt, 1 / 0.07)  # the same maths left to autocast runs in bf16
    assert logits.dtype == torch.float32 and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (control.float() - want).abs() > 1e-5  # while the fp32 path agrees to 1e-6


def test_sample_weights_give_a_weighted_mean() -> None:
    img, txt = torch.randn(4, 8), torch.randn(4, 8)
    loss_fn = ContrastiveLoss()
    w = torch.tensor([1.0, 0.0, 0.0, 0.0])
    logits_i2t, logits_t2i, targets = loss_fn.logits(img, txt)
    row0 = 0.5 * (F.cross_entropy(logits_i2t[:1], targets[:1]) + F.cross_entropy(logits_t2i[:1], targets[:1]))
    torch.testing.assert_close(loss_fn(img, txt, sample_weights=w), row0)


def test_hard_negatives_follow_softmax_and_skip_positives() -> None:
    scores = torch.tensor([[5.0, 1.0, 0.0, 1.0], [0.0, 9.0, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0]])
    positive = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_hard_negatives(scores, positive, g) for _ in range(4000)])
    assert (draws[:, 1] == 0).all()  # the only admissible column
    assert (draws[:, 2] == -1).all()  # no admissible column
    freq = torch.bincount(draws[:, 0], minlength=4).float() / len(draws)
    want = torch.softmax(torch.tensor([1.0, 0.0, 1.0]), 0)
    assert freq[0] == 0
    torch.testing.assert_close(freq[1:], want, atol=0.03, rtol=0)


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
