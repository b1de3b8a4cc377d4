"""Process bodies for the 2-process gloo tests (spawned; results are written to ``out_dir``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from mm_lightning import distributed
from mm_lightning.models import ContrastiveLoss, itm
from mm_lightning.models.itm import ImageTextMatching
from mm_lightning.models.losses import PairLogits, clip

N_PER_RANK, DIM = 4, 8


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _gather_without_grad(tensor: torch.Tensor) -> torch.Tensor:
    """The classic bug: other ranks' slices are constants, so their loss terms never reach this rank."""
    chunks = list(distributed.gather_no_grad(tensor.detach()).chunk(dist.get_world_size()))
    chunks[dist.get_rank()] = tensor
    return torch.cat(chunks)


def global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Image features, text features and image ids of the concatenated batch (identical on every rank)."""
    g = torch.Generator().manual_seed(123)
    n = world * N_PER_RANK
    image_ids = torch.arange(n) // 2  # two captions per image
    image_ids[N_PER_RANK - 1] = image_ids[N_PER_RANK]  # an image whose captions sit on different ranks
    return torch.randn(n, DIM, generator=g), torch.randn(n, DIM, generator=g), image_ids


def reference(world: int) -> dict[str, torch.Tensor]:
    """Single-process loss and gradients on the concatenated batch (no process group involved)."""
    img, txt, ids = global_batch(world)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    loss_fn = ContrastiveLoss(global_negatives=False)
    loss = loss_fn(img, txt, ids)
    loss.backward()
    return {"loss": loss.detach(), "img": img.grad, "txt": txt.grad, "scale": loss_fn.logit_scale.grad}


def contrastive_case(rank: int, world: int, ref: dict, mode: str) -> dict:
    """mode: ``global`` (gather with grad), ``no_grad_gather`` (control) or ``local`` (local negatives)."""
    img, txt, ids = global_batch(world)
    rows = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    img, txt = img[rows].clone().requires_grad_(True), txt[rows].clone().requires_grad_(True)
    loss_fn = ContrastiveLoss(global_negatives=mode != "local")
    loss = loss_fn(img, txt, ids[rows])
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    scale_grad = loss_fn.logit_scale.grad.clone()
    dist.all_reduce(scale_grad)
    scale_grad /= world
    return {
        "rank_loss": loss.detach(),
        "mean_loss": mean_loss,
        "img_grad": img.grad,
        "txt_grad": txt.grad,
        "scale_grad": scale_grad,
        "ref": ref,
        "rows": (rows.start, rows.stop),
    }


def itm_case(rank: int, world: int) -> dict:
    """ITM with global negatives where every local non-positive column is excluded, so rank 0's negatives
    come from rank 1; rank 1 zeroes its own loss, so any gradient on its tokens came from rank 0."""
    torch.manual_seed(0)  # same ITM weights on both ranks
    matcher = ImageTextMatching(image_token_dim=6, text_token_dim=5, dim=8, num_heads=2)
    torch.manual_seed(1 + rank)
    length = 3 + rank  # different padded lengths per rank
    image_tokens = torch.randn(N_PER_RANK, 4, 6, requires_grad=True)
    text_tokens = torch.randn(N_PER_RANK, length, 5, requires_grad=True)
    mask = torch.ones(N_PER_RANK, length, dtype=torch.bool)
    ids = torch.arange(N_PER_RANK) + rank * N_PER_RANK
    logits = torch.zeros(N_PER_RANK, world * N_PER_RANK)
    local = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    logits[:, local] = -1e9  # softmax weight 0 on local columns
    all_ids = torch.arange(world * N_PER_RANK)
    pair_logits = PairLogits(
        logits, logits.clone(), torch.arange(N_PER_RANK), all_ids, global_candidates=True
    )
    loss, _ = matcher(image_tokens, text_tokens, mask, pair_logits, ids)
    (loss * (1.0 if rank == 0 else 0.0)).backward()
    return {"text_grad_norm": text_tokens.grad.norm(), "image_grad_norm": image_tokens.grad.norm()}


def gather_rows_case(rank: int) -> dict:
    """Ranks with different row counts (3 and 1 rows) gathered in rank order."""
    rows = torch.arange(3 - 2 * rank, dtype=torch.float32)[:, None].expand(-1, 2) + 10 * rank
    return {
        "gathered": distributed.gather_rows(rows),
        "mean": distributed.all_reduce_mean(torch.tensor(rank + 1.0)),
    }


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Runs every case in one process group (spawning is the slow part) and saves ``{case: result}``."""
    ref = reference(world)  # before the process group exists, so it is truly single-process
    _init(rank, world, port)
    results = {
        f"contrastive_{mode}": contrastive_case(rank, world, ref, mode) for mode in ("global", "local")
    }
    results["itm_global"] = itm_case(rank, world)
    results["gather_rows"] = gather_rows_case(rank)
    # controls: the same code with an all-gather that carries no gradient
    clip.gather_with_grad = itm.gather_with_grad = _gather_without_grad
    results["contrastive_no_grad_gather"] = contrastive_case(rank, world, ref, "global")
    results["itm_no_grad_gather"] = itm_case(rank, world)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
