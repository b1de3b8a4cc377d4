"""Hard-negative sampling for ITM: draws follow softmax(score) over admissible columns only."""

from __future__ import annotations

import torch

from mm_lightning.models.itm import sample_hard_negatives


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
