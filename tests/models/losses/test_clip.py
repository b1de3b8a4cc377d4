"""ContrastiveLoss (single process): CLIP formula, same-image masking, fp32 math, weights, its options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mm_lightning.models import ContrastiveLoss


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
        logits = loss_fn.logits(img, txt).i2t
        got = loss_fn(img, txt)
        control = clip_reference(img, txt, 1 / 0.07)  # the same maths left to autocast runs in bf16
    assert logits.dtype == torch.float32 and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (control.float() - want).abs() > 1e-5  # while the fp32 path agrees to 1e-6


def test_sample_weights_give_a_weighted_mean() -> None:
    img, txt = torch.randn(4, 8), torch.randn(4, 8)
    loss_fn = ContrastiveLoss()
    w = torch.tensor([1.0, 0.0, 0.0, 0.0])
    logits = loss_fn.logits(img, txt)
    row0 = 0.5 * (
        F.cross_entropy(logits.i2t[:1], logits.targets[:1])
        + F.cross_entropy(logits.t2i[:1], logits.targets[:1])
    )
    torch.testing.assert_close(loss_fn(img, txt, sample_weights=w), row0)


def test_logits_say_whether_candidates_are_global_and_carry_their_ids() -> None:
    ids = torch.tensor([3, 3, 7])
    logits = ContrastiveLoss().logits(torch.randn(3, 4), torch.randn(3, 4), ids)
    assert logits.global_candidates is False  # one process: the local batch is every candidate
    assert logits.candidate_ids.tolist() == [3, 3, 7] and logits.targets.tolist() == [0, 1, 2]


def test_constructor_options_reach_the_loss() -> None:
    """The options a config gives as ``model.loss.init_args`` (class_path ContrastiveLoss)."""
    loss = ContrastiveLoss(temperature_init=0.05, learnable_temperature=False, global_negatives=False)
    assert isinstance(loss, ContrastiveLoss) and not loss.logit_scale.requires_grad
    assert loss.temperature.item() == pytest.approx(0.05)
