"""SigLIP loss on one process: the paper's formula, multi-caption positives, initialization, gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mm_lightning.models.losses.siglip import SigLipLoss


def _paper_loss(
    img: torch.Tensor, txt: torch.Tensor, labels: torch.Tensor, t: float, b: float
) -> torch.Tensor:
    """Algorithm 1 of the SigLIP paper, written out pair by pair."""
    img, txt = F.normalize(img, dim=-1), F.normalize(txt, dim=-1)
    total = torch.zeros(())
    for i in range(len(img)):
        for j in range(len(txt)):
            z = labels[i, j]
            total = total - F.logsigmoid(z * (math.exp(t) * img[i] @ txt[j] + b))
    return total / len(img)


def test_initialization_follows_the_paper() -> None:
    loss = SigLipLoss()
    assert loss.logit_scale.item() == pytest.approx(math.log(10))
    assert loss.logit_bias.item() == pytest.approx(-10.0)
    assert loss.temperature.item() == pytest.approx(0.1)


def test_matches_the_paper_formula_with_shared_images_as_positives() -> None:
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    ids = torch.tensor([0, 0, 1, 2, 3])  # the first two captions describe one image
    labels = (ids[:, None] == ids[None, :]).float() * 2 - 1
    loss_fn = SigLipLoss(temperature_init=0.5, bias_init=-2.0)
    got = loss_fn(img, txt, ids)
    want = _paper_loss(img, txt, labels, math.log(2.0), -2.0)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    # without ids only the diagonal matches: a different loss
    assert loss_fn(img, txt).item() != pytest.approx(got.item(), rel=1e-3)


def test_gradients_reach_temperature_bias_and_features() -> None:
    img = torch.randn(6, 4, requires_grad=True)
    txt = torch.randn(6, 4, requires_grad=True)
    loss_fn = SigLipLoss()
    loss_fn(img, txt).backward()
    for grad in (img.grad, txt.grad, loss_fn.logit_scale.grad, loss_fn.logit_bias.grad):
        assert grad is not None and grad.abs().max() > 0


def test_sample_weights_and_frozen_parameters() -> None:
    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    loss_fn = SigLipLoss(learnable_temperature=False, learnable_bias=False)
    assert not loss_fn.logit_scale.requires_grad and not loss_fn.logit_bias.requires_grad
    uniform = loss_fn(img, txt, sample_weights=torch.ones(4))
    assert uniform.item() == pytest.approx(loss_fn(img, txt).item())
    only_first = loss_fn(img, txt, sample_weights=torch.tensor([1.0, 0, 0, 0]))
    first_row = _paper_loss(img[:1], txt, torch.tensor([[1.0, -1, -1, -1]]), math.log(10), -10.0)
    assert only_first.item() == pytest.approx(first_row.item(), rel=1e-5)


def test_mining_logits_are_ordered_like_the_loss() -> None:
    img = torch.randn(3, 4)
    txt = torch.randn(3, 4)
    logits = SigLipLoss().logits(img, txt, torch.arange(3))
    assert logits.i2t.shape == logits.t2i.shape == (3, 3) and not logits.global_candidates
    torch.testing.assert_close(logits.i2t, logits.t2i.T)
    assert logits.targets.tolist() == [0, 1, 2] and logits.candidate_ids.tolist() == [0, 1, 2]


def test_bias_init_and_loss_from_local_logits_equals_the_loss() -> None:
    loss_fn = SigLipLoss(bias_init=-5.0)  # model.loss: {class_path: SigLipLoss, init_args: {bias_init: -5}}
    assert isinstance(loss_fn, SigLipLoss) and loss_fn.logit_bias.item() == -5.0
    g = torch.Generator().manual_seed(2)
    img, txt = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    ids = torch.tensor([0, 0, 1, 2, 3])
    weights = torch.rand(5, generator=g)
    got = loss_fn.loss_from_logits(loss_fn.logits(img, txt, ids), weights)
    assert got.item() == pytest.approx(loss_fn(img, txt, ids, weights).item(), rel=1e-6)
    global_logits = loss_fn.logits(img, txt, ids)._replace(global_candidates=True)
    with pytest.raises(ValueError, match="ring"):
        loss_fn.loss_from_logits(global_logits)
