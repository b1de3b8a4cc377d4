"""Hard-negative sampling and the matching head: draws follow softmax(score) over admissible columns only, and
the step has fixed shapes, so it never waits for the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm_lightning.models.itm import ImageTextMatching, sample_hard_negatives
from mm_lightning.models.losses import ContrastiveLoss
from tests.host_syncs import host_syncs


def test_hard_negatives_follow_softmax_and_skip_positives() -> None:
    scores = torch.tensor([[5.0, 1.0, 0.0, 1.0], [0.0, 9.0, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0]])
    positive = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    draws, has_negative = zip(*(sample_hard_negatives(scores, positive, g) for _ in range(4000)), strict=True)
    draws = torch.stack(draws)
    assert (draws[:, 1] == 0).all()  # the only admissible column
    assert all(h.tolist() == [True, True, False] for h in has_negative)  # row 2 has no admissible column
    freq = torch.bincount(draws[:, 0], minlength=4).float() / len(draws)
    want = torch.softmax(torch.tensor([1.0, 0.0, 1.0]), 0)
    assert freq[0] == 0
    torch.testing.assert_close(freq[1:], want, atol=0.03, rtol=0)


def test_hard_negatives_are_torch_multinomials_draws() -> None:
    scores, positive = torch.randn(64, 64), torch.eye(64, dtype=torch.bool)
    probs = torch.softmax(scores.masked_fill(positive, float("-inf")), 1)
    drawn, _ = sample_hard_negatives(scores, positive, torch.Generator().manual_seed(3))
    multinomial = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3)).squeeze(1)
    assert torch.equal(drawn, multinomial)
    # control: another generator state draws other columns, so the equality above is not a given
    other, _ = sample_hard_negatives(scores, positive, torch.Generator().manual_seed(4))
    assert not torch.equal(other, multinomial)


def _reference_itm(itm: ImageTextMatching, image_tokens, text_tokens, mask, logits, ids, weights=None):  # noqa: ANN001, ANN202
    """The matching head as it was with data-dependent shapes: only rows with a negative are scored."""
    img, txt, mask = itm.image_proj(image_tokens), itm.text_proj(text_tokens), mask.bool()
    same = ids[:, None] == logits.candidate_ids[None, :]

    def draw(scores: torch.Tensor) -> torch.Tensor:
        masked = scores.float().masked_fill(same, float("-inf"))
        has = (~same).any(1)
        out = torch.full((scores.shape[0],), -1, dtype=torch.long)
        out[has] = torch.multinomial(torch.softmax(masked[has], 1), 1).squeeze(1)
        return out

    neg_text, neg_image = draw(logits.i2t.detach()), draw(logits.t2i.detach())
    has_t, has_i = neg_text >= 0, neg_image >= 0
    images = torch.cat([img, img[has_t], img[neg_image[has_i]]])
    texts = torch.cat([txt, txt[neg_text[has_t]], txt[has_i]])
    masks = torch.cat([mask, mask[neg_text[has_t]], mask[has_i]])
    labels = torch.cat(
        [
            torch.ones(len(img), dtype=torch.long),
            torch.zeros(int(has_t.sum() + has_i.sum()), dtype=torch.long),
        ]
    )
    scores = itm.head(itm.fusion(images, texts, masks))
    per_pair = F.cross_entropy(scores.float(), labels, reduction="none")
    accuracy = (scores.argmax(-1) == labels).float().mean()
    if weights is None:
        return per_pair.mean(), accuracy
    w = torch.cat([weights, weights[has_t], weights[has_i]])
    return (per_pair * w).sum() / w.sum(), accuracy


def _batch(ids: list[int]) -> tuple:
    torch.manual_seed(0)
    b = len(ids)
    itm = ImageTextMatching(16, 12, 16, num_heads=4)
    emb = torch.randn(b, 8), torch.randn(b, 8)
    _, logits = ContrastiveLoss().loss_and_logits(*emb, torch.tensor(ids))
    mask = torch.ones(b, 7, dtype=torch.bool)
    mask[::2, 5:] = False  # captions of two lengths
    return itm, (torch.randn(b, 5, 16), torch.randn(b, 7, 12), mask, logits, torch.tensor(ids))


def _loss_accuracy_grads(forward, itm, inputs, weights=None, seed=7):  # noqa: ANN001, ANN202
    itm.zero_grad()
    torch.manual_seed(seed)
    loss, accuracy = forward(itm, *inputs, weights)
    loss.backward()
    return loss.detach(), accuracy, [p.grad.clone() for p in itm.parameters()]


def test_matching_loss_accuracy_and_gradients_equal_the_row_dropping_heads() -> None:
    itm, inputs = _batch([0, 0, 1, 2, 3, 4, 5, 5])  # two images with two captions: every row has a negative
    weights = torch.linspace(0.5, 2.0, 8)
    for w in (None, weights):
        want = _loss_accuracy_grads(_reference_itm, itm, inputs, w)
        got = _loss_accuracy_grads(ImageTextMatching.forward, itm, inputs, w)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
        assert got[1] == want[1]
        for g, r in zip(got[2], want[2], strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    # control: other draws (another seed) give another loss, so the comparison above sees the draws
    other = _loss_accuracy_grads(ImageTextMatching.forward, itm, inputs, None, seed=8)
    assert not torch.allclose(other[0], _loss_accuracy_grads(_reference_itm, itm, inputs)[0])


def test_a_row_without_negative_is_weighted_zero_as_when_it_was_dropped() -> None:
    itm, inputs = _batch([0, 0, 0, 0])  # one image: no row has a negative
    loss, accuracy, grads = _loss_accuracy_grads(ImageTextMatching.forward, itm, inputs)
    want, want_accuracy, want_grads = _loss_accuracy_grads(_reference_itm, itm, inputs)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert accuracy == want_accuracy
    for g, r in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_the_matching_step_never_waits_for_the_device() -> None:
    itm, inputs = _batch([0, 0, 1, 2, 3, 4, 5, 5])
    with host_syncs() as syncs:
        _loss_accuracy_grads(ImageTextMatching.forward, itm, inputs, torch.ones(8))
    assert syncs.records == []
    # control: the row-dropping head waits (boolean indexing, counts, multinomial's checks)
    with host_syncs() as syncs:
        _loss_accuracy_grads(_reference_itm, itm, inputs, torch.ones(8))
    assert {op for op, _ in syncs.records} >= {"aten.index.Tensor", "aten._local_scalar_dense.default"}
