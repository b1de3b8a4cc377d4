"""Re-ranking with the matching head: LAVIS's rule (top k by cosine re-scored with match logit + cosine), checked
against a brute-force reference on every pair; and through validation and ``evaluate``."""

from __future__ import annotations

import pytest
import torch

from mm_lightning.evaluation.metrics import l2_normalize, retrieval_metrics
from mm_lightning.evaluation.rerank import Reranker
from mm_lightning.models.itm import ImageTextMatching

IMAGES, CAPTIONS, K = 12, 2, 4


def rows_in_two_batches(seed: int = 0) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """24 caption rows (2 per image) as two batches whose captions are padded to different lengths; and the
    per-image and per-caption tensors they were cut from."""
    g = torch.Generator().manual_seed(seed)
    image_emb, image_tokens = torch.randn(IMAGES, 6, generator=g), torch.randn(IMAGES, 5, 8, generator=g)
    n = IMAGES * CAPTIONS
    text_emb, text_tokens = torch.randn(n, 6, generator=g), torch.randn(n, 7, 8, generator=g)
    lengths = torch.randint(2, 8, (n,), generator=g)
    mask = torch.arange(7)[None, :] < lengths[:, None]
    ids = torch.arange(n) // CAPTIONS
    batches = []
    for rows, width in ((torch.arange(0, 10), 7), (torch.arange(10, n), 5)):
        lengths[rows] = lengths[rows].clamp_max(width)
        batches.append(
            {
                "index": rows,
                "ids": ids[rows],
                "image_emb": image_emb[ids[rows]],
                "text_emb": text_emb[rows],
                "image_tokens": image_tokens[ids[rows]],
                "text_tokens": text_tokens[rows, :width],
                "text_mask": mask[rows, :width] & (torch.arange(width)[None, :] < lengths[rows, None]),
            }
        )
    mask = torch.arange(7)[None, :] < lengths[:, None]
    return batches, {"image_emb": image_emb, "image_tokens": image_tokens, "text_emb": text_emb,
                     "text_tokens": text_tokens * mask[..., None], "text_mask": mask, "ids": ids}  # fmt: skip


def lavis_recall(
    itm: ImageTextMatching, data: dict[str, torch.Tensor], k: int, n: int
) -> tuple[float, float]:
    """R@n both ways as LAVIS computes it: -100 everywhere, each query's top k set to match logit + cosine."""
    images, texts = l2_normalize(data["image_emb"]), l2_normalize(data["text_emb"])
    img_tokens, txt_tokens = itm.image_proj(data["image_tokens"]), itm.text_proj(data["text_tokens"])
    logits = torch.stack(
        [
            itm.match_logits(img_tokens[i].expand(len(texts), -1, -1), txt_tokens, data["text_mask"])
            for i in range(len(images))
        ],
        dim=1,
    )  # (captions, images): every pair scored
    sim = texts @ images.T
    t2i = torch.full_like(sim, -100.0)
    for t in range(len(texts)):
        top = sim[t].topk(k).indices
        t2i[t, top] = logits[t, top] + sim[t, top]
    i2t = torch.full_like(sim.T, -100.0)
    for i in range(len(images)):
        top = sim[:, i].topk(k).indices
        i2t[i, top] = logits[top, i] + sim[top, i]
    ids = data["ids"]
    text_hits = [ids[t].item() in t2i[t].topk(n).indices.tolist() for t in range(len(texts))]
    image_hits = [bool((ids[i2t[i].topk(n).indices] == i).any()) for i in range(len(images))]
    return sum(text_hits) / len(text_hits), sum(image_hits) / len(image_hits)


@torch.no_grad()
def test_reranked_recall_equals_lavis_rule_on_every_pair() -> None:
    torch.manual_seed(0)
    itm = ImageTextMatching(8, 8, 16, num_heads=2).eval()
    batches, data = rows_in_two_batches()
    reranker = Reranker(K)
    for rows in reversed(batches):  # any arrival order: rows are put back in file order
        reranker.add(itm, rows)
    ranks = reranker.ranks(itm, torch.tensor(0.0))
    plain = retrieval_metrics(data["image_emb"][data["ids"]], data["text_emb"], data["ids"], ks=(1, 2, 4))
    differs = False
    for n in (1, 2, 4):
        t2i, i2t = lavis_recall(itm, data, K, n)
        assert (ranks.t2i < n).float().mean().item() == pytest.approx(t2i), n
        assert (ranks.i2t < n).float().mean().item() == pytest.approx(i2t), n
        differs |= (t2i, i2t) != (plain[f"r{n}_t2i"].item(), plain[f"r{n}_i2t"].item())
    assert differs  # the matching head changed the order: the comparison above can fail


@torch.no_grad()
def test_a_head_without_opinion_keeps_the_cosine_order() -> None:
    """Control: a constant match logit leaves the top k in cosine order, so the ranks are the plain ones."""
    itm = ImageTextMatching(8, 8, 16, num_heads=2).eval()
    itm.match_logits = lambda image_tokens, text_tokens, text_mask: torch.zeros(len(image_tokens))
    batches, data = rows_in_two_batches(seed=1)
    reranker = Reranker(K)
    for rows in batches:
        reranker.add(itm, rows)
    ranks = reranker.ranks(itm, torch.tensor(0.0))
    plain = retrieval_metrics(data["image_emb"][data["ids"]], data["text_emb"], data["ids"], ks=(1, 2, 4, 24))
    for n in (1, 2, 4, 24):  # beyond k too: the other candidates keep their cosine order below the top k
        assert (ranks.t2i < n).float().mean().item() == plain[f"r{n}_t2i"].item()
        assert (ranks.i2t < n).float().mean().item() == plain[f"r{n}_i2t"].item()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_validation_reports_reranked_recall_and_needs_the_head(tmp_path, precision: str) -> None:
    """Under bf16 autocast too: the re-ranking runs at the epoch's end, outside the steps' autocast."""
    from lightning.pytorch import Trainer

    from mm_lightning.evaluation.rerank import NoMatchingHead
    from tests.models.helpers import make_batch, tiny_module

    batch = make_batch(size=12, captions_per_image=2, seed=3)
    loader = torch.utils.data.DataLoader(
        [{k: v[i] for k, v in batch.items()} for i in range(12)], batch_size=5
    )
    trainer = Trainer(
        accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    torch.manual_seed(0)
    metrics = trainer.validate(tiny_module(reranker=Reranker(3)), loader, verbose=False)[0]
    assert {"val/reranked_r1_t2i", "val/reranked_r10_i2t", "val/r1_t2i", "val/loss"} <= set(metrics)
    assert "val/reranked_alignment_gap" not in metrics
    with pytest.raises(NoMatchingHead, match="itm_weight"):
        trainer.validate(tiny_module(reranker=Reranker(3), objective={"itm_weight": 0.0}), loader)
