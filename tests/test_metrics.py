"""Retrieval metrics vs. a brute-force sort-based reference (ties, multi-caption, chunking)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mm_lightning.evaluation.metrics import (
    RetrievalMetrics,
    dedup_images,
    retrieval_metrics,
    similarity_retrieval_metrics,
)


def brute_force(sim: torch.Tensor, column: torch.Tensor, ks=(1, 5, 10)) -> dict[str, float]:
    """Sorts candidates one query at a time; ties are broken against the query (correct items sorted last)."""
    sim = sim.tolist()
    col = column.tolist()
    n_text, n_img = len(sim), len(sim[0])
    t2i_pos, i2t_pos = [], []
    for t in range(n_text):
        order = sorted(range(n_img), key=lambda j: (-sim[t][j], j == col[t]))
        t2i_pos.append(order.index(col[t]))
    for i in range(n_img):
        order = sorted(range(n_text), key=lambda t: (-sim[t][i], col[t] == i))
        # position of the first correct caption; captions of this image before it do not push it down
        first = next(p for p, t in enumerate(order) if col[t] == i)
        i2t_pos.append(sum(1 for t in order[:first] if col[t] != i))
    out = {}
    for k in ks:
        out[f"r{k}_t2i"] = sum(p < k for p in t2i_pos) / n_text
        out[f"r{k}_i2t"] = sum(p < k for p in i2t_pos) / n_img
    pos = [sim[t][col[t]] for t in range(n_text)]
    neg = [sim[t][j] for t in range(n_text) for j in range(n_img) if j != col[t]]
    out["alignment_gap"] = sum(pos) / len(pos) - sum(neg) / len(neg)
    return out


def assert_metrics_equal(got: dict[str, torch.Tensor], want: dict[str, float]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].item() == pytest.approx(value, abs=1e-6), key


def test_hand_made_matrix_with_ties_and_two_captions_per_image() -> None:
    # 3 images; captions 0,1 -> image 0; caption 2 -> image 1; captions 3,4 -> image 2
    sim = torch.tensor(
        [
            [0.9, 0.1, 0.2],  # correct, clear winner
            [0.5, 0.5, 0.1],  # tie with a wrong image: counts as a miss at k=1
            [0.3, 0.8, 0.8],  # tie again: miss at 1, hit at 5
            [0.2, 0.1, 0.7],  # correct
            [0.9, 0.0, 0.4],  # wrong image wins
        ]
    )
    column = torch.tensor([0, 0, 1, 2, 2])
    got = similarity_retrieval_metrics(sim, column, ks=(1, 2))
    # t2i: captions 0 and 3 hit at 1; captions 1, 2 (ties) and 4 (0.9 > 0.4) have exactly one wrong image ahead
    assert got["r1_t2i"].item() == pytest.approx(2 / 5)
    assert got["r2_t2i"].item() == pytest.approx(5 / 5)
    # i2t: image 0's best caption (0.9) ties caption 4 of image 2 -> miss at 1; image 1's caption (0.8) beats
    # all others (<= 0.5) -> hit; image 2's best caption (0.7) is beaten by caption 2 of image 1 (0.8) -> miss
    assert got["r1_i2t"].item() == pytest.approx(1 / 3)
    assert_metrics_equal(got, brute_force(sim, column, ks=(1, 2)))


@pytest.mark.parametrize("seed", range(5))
def test_random_quantized_scores_match_brute_force(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n_img = 12
    column = torch.randint(0, n_img, (30,), generator=g)
    column[:n_img] = torch.arange(n_img)  # every image has at least one caption
    sim = torch.randint(0, 4, (30, n_img), generator=g).float() / 4  # few levels -> many ties
    assert_metrics_equal(similarity_retrieval_metrics(sim, column, chunk_size=7), brute_force(sim, column))


def test_brute_force_reference_detects_wrong_tie_rule() -> None:
    """Control: an optimistic tie rule (ties count for the query) disagrees with the reference."""
    sim = torch.ones(4, 4)
    column = torch.arange(4)
    want = brute_force(sim, column, ks=(1,))
    assert want["r1_t2i"] == 0.0
    optimistic = ((sim > sim.gather(1, column[:, None])).sum(1) < 1).float().mean().item()
    assert optimistic == 1.0 != want["r1_t2i"]
    assert_metrics_equal(similarity_retrieval_metrics(sim, column, ks=(1,)), want)


def test_embeddings_path_dedups_images_and_uses_cosine() -> None:
    g = torch.Generator().manual_seed(0)
    distinct = torch.randn(5, 8, generator=g)
    image_ids = torch.tensor([10, 10, 11, 12, 12, 12, 13, 14])
    rows_img = distinct[torch.unique(image_ids, return_inverse=True)[1]] * torch.rand(8, 1, generator=g).add(
        0.5
    )
    text = torch.randn(8, 8, generator=g)
    got = retrieval_metrics(rows_img, text, image_ids, chunk_size=3)
    _, images, column = dedup_images(rows_img, image_ids)
    assert images.shape[0] == 5 and column.tolist() == [0, 0, 1, 2, 2, 2, 3, 4]
    sim = F.normalize(text, dim=-1) @ F.normalize(distinct, dim=-1).T
    assert_metrics_equal(got, brute_force(sim, column))


def test_perfect_embeddings_score_one_and_positive_gap() -> None:
    emb = torch.eye(6)
    got = retrieval_metrics(emb, emb, torch.arange(6))
    assert got["r1_t2i"].item() == 1.0 and got["r1_i2t"].item() == 1.0
    assert got["alignment_gap"].item() == pytest.approx(1.0)


def _rows(seed: int = 0, n_images: int = 6, captions: int = 2) -> dict[str, torch.Tensor]:
    """Multi-caption rows: each image's embedding repeated on its caption rows, random caption embeddings."""
    g = torch.Generator().manual_seed(seed)
    image_id = torch.arange(n_images).repeat_interleave(captions) + 100
    distinct = torch.randn(n_images, 8, generator=g)
    return {
        "image": distinct.repeat_interleave(captions, 0),
        "text": distinct.repeat_interleave(captions, 0) + 1.5 * torch.randn(len(image_id), 8, generator=g),
        "image_id": image_id,
        "index": torch.arange(len(image_id)),
    }


def _metric_over(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    metric = RetrievalMetrics()
    for b in batches:
        metric.update(b["image"], b["image_id"], b["text"], b["image_id"], b["index"])
    return metric.compute()


def test_metric_over_batches_equals_the_functional_metrics() -> None:
    rows = _rows()
    want = retrieval_metrics(rows["image"], rows["text"], rows["image_id"])
    batches = [
        {k: v[s : s + 5] for k, v in rows.items()} for s in range(0, 12, 5)
    ]  # images split over batches
    got = _metric_over(batches)
    assert_metrics_equal(got, {k: v.item() for k, v in want.items()})


def test_metric_takes_each_image_once_or_per_row_alike() -> None:
    rows = _rows()
    per_row = _metric_over([rows])
    metric = RetrievalMetrics()
    first = torch.arange(0, 12, 2)  # one row per distinct image
    metric.update(
        rows["image"][first], rows["image_id"][first], rows["text"], rows["image_id"], rows["index"]
    )
    assert_metrics_equal(metric.compute(), {k: v.item() for k, v in per_row.items()})


def test_duplicate_records_count_once_on_one_device() -> None:
    """Under on_bad_record=skip a replacement sample appears twice (same index): it must not count twice."""
    rows = _rows(seed=3)
    unique = _metric_over([rows])
    duplicated = {k: torch.cat([v, v[:1].repeat(5, *([1] * (v.dim() - 1)))]) for k, v in rows.items()}
    got = _metric_over([duplicated])
    assert_metrics_equal(got, {k: v.item() for k, v in unique.items()})
    # control: the same rows without deduplication by index score differently
    naive = retrieval_metrics(duplicated["image"], duplicated["text"], duplicated["image_id"])
    assert any(abs(naive[k].item() - unique[k].item()) > 1e-3 for k in unique)


def test_metric_refuses_captions_of_images_never_added() -> None:
    metric = RetrievalMetrics()
    metric.update(
        torch.randn(1, 4), torch.tensor([1]), torch.randn(2, 4), torch.tensor([1, 2]), torch.arange(2)
    )
    with pytest.raises(ValueError, match="never added"):
        metric.compute()


def test_eval_rows_count_each_valid_record_once_per_epoch() -> None:
    """Stand-ins never count; a record counts at its first genuine row, even after a stand-in copy of it."""
    from mm_lightning.evaluation.validation import EvalRows

    rows = EvalRows()
    keep = rows.keep(torch.tensor([5, 3, 5, 7]), torch.tensor([False, False, False, True]))
    assert keep.tolist() == [True, True, False, False]  # 5 again: a sampler's padding; 7: a stand-in copy
    assert rows.keep(torch.tensor([7, 3]), torch.tensor([False, False])).tolist() == [True, False]
    rows.reset()  # a new evaluation epoch
    assert rows.keep(torch.tensor([3]), torch.tensor([False])).tolist() == [True]
