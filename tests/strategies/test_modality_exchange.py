"""The row exchange of modality parallelism on 3 gloo processes (2 image + 1 text, a global batch of 6): each
process ends with its block (DDP rank r's rows) of both modalities, tokens and masks included, though the image
processes' rows straddle the blocks; the backward returns each row's gradient to the process that embedded it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mm_lightning.data.collate import load_tokenizer
from mm_lightning.extras.modality_parallel import Layout, ModalityExchange, caption_rows, padded_length
from mm_lightning.models.towers.contract import EncoderOutput

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LAYOUT = Layout(image_processes=2, text_processes=1)
ROWS, DIM = 6, 4
TOKENS = {"image": (3, 5), "text": (4, 7)}  # (length, width) of each tower's tokens


def global_batch(kind: str) -> dict[str, torch.Tensor]:
    """Every row of one modality, the same on every process; the weights make each row's gradient distinct."""
    generator = torch.Generator().manual_seed(0 if kind == "image" else 1)
    length, width = TOKENS[kind]
    mask = torch.rand(ROWS, length, generator=generator) > 0.3
    return {
        "emb": torch.randn(ROWS, DIM, generator=generator),
        "tokens": torch.randn(ROWS, length, width, generator=generator),
        "mask": mask,
        "emb_weight": torch.randn(ROWS, DIM, generator=generator),
        "token_weight": torch.randn(ROWS, length, width, generator=generator),
    }


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=LAYOUT.world)
    for differentiable in (True, False):
        result = exchange_once(rank, differentiable)
        torch.save(result, Path(out) / f"rank{rank}_{'graph' if differentiable else 'detached'}.pt")
    dist.destroy_process_group()


def exchange_once(rank: int, differentiable: bool) -> dict:
    """This process's rows through the exchange, a loss on its block, and what came back."""
    rows = slice(*LAYOUT.owned(rank, ROWS))
    mine = global_batch(LAYOUT.kind(rank))
    emb = mine["emb"][rows].clone().requires_grad_()
    tokens = mine["tokens"][rows].clone().requires_grad_()
    exchange = ModalityExchange(LAYOUT, rank, {k: width for k, (_, width) in TOKENS.items()})
    sent = (emb, tokens) if differentiable else (emb.detach(), tokens.detach())
    received = exchange.exchange(ROWS, sent[0], EncoderOutput(sent[0], sent[1], mine["mask"][rows]))
    block = slice(*LAYOUT.block(rank, ROWS))
    loss = sum(
        (part.pooled * global_batch(k)["emb_weight"][block]).sum()
        + (part.tokens * global_batch(k)["token_weight"][block]).sum()
        for k, (part, _) in zip(("image", "text"), received, strict=True)
    )
    loss.backward()  # every process, as in a step: the exchange's backward is a collective
    return {
        "received": [(part.pooled.detach(), part.tokens.detach(), part.mask) for part, _ in received],
        "emb_grad": emb.grad,
        "token_grad": tokens.grad,
        "ids": exchange.exchange_ids(torch.arange(ROWS)[rows] * 10, ROWS),
    }


def run(tmp_path: Path) -> dict[str, list[dict]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # forked: the processes need none of their own imports (tensors of a few rows, one thread each)
    mp.start_processes(
        worker, args=(port, str(tmp_path)), nprocs=LAYOUT.world, join=True, start_method="fork"
    )
    return {
        mode: [torch.load(tmp_path / f"rank{rank}_{mode}.pt") for rank in range(LAYOUT.world)]
        for mode in ("graph", "detached")
    }


def test_each_process_gets_its_block_and_each_owner_its_rows_gradients(tmp_path: Path) -> None:
    runs = run(tmp_path)
    for rank, result in enumerate(runs["graph"]):
        block = slice(*LAYOUT.block(rank, ROWS))
        for kind, (emb, tokens, mask) in zip(("image", "text"), result["received"], strict=True):
            expected = global_batch(kind)
            torch.testing.assert_close(emb, expected["emb"][block], rtol=0, atol=0)
            torch.testing.assert_close(tokens, expected["tokens"][block], rtol=0, atol=0)
            assert torch.equal(mask, expected["mask"][block])
        assert result["ids"].tolist() == [10 * row for row in range(ROWS)][block]
        # each row's gradient is its loss weight, wherever its block was scored
        owned = slice(*LAYOUT.owned(rank, ROWS))
        expected = global_batch(LAYOUT.kind(rank))
        torch.testing.assert_close(result["emb_grad"], expected["emb_weight"][owned], rtol=0, atol=0)
        torch.testing.assert_close(result["token_grad"], expected["token_weight"][owned], rtol=0, atol=0)

    # Control: rows sent without their graph bring no gradient back to the processes that embedded them.
    assert all(result["emb_grad"] is None and result["token_grad"] is None for result in runs["detached"])


def test_the_layout_sends_every_row_once_and_fills_every_block() -> None:
    for image, text, rows in ((1, 1, 8), (2, 1, 6), (1, 3, 12), (3, 3, 12)):
        layout = Layout(image, text)
        for kind in ("image", "text"):
            owners = layout.ranks(kind)
            sent = [sum(layout.sends(rank, rows)) for rank in owners]
            assert sent == [rows // len(owners)] * len(owners)
        for rank in range(layout.world):
            received = layout.receives(rank, rows)
            share = rows // layout.world
            assert sum(received[p] for p in layout.ranks("image")) == share
            assert sum(received[p] for p in layout.ranks("text")) == share


@pytest.mark.parametrize(("image", "text"), [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)])
def test_each_process_embeds_its_rows_once_in_pieces_of_one_ddp_rank_each(image: int, text: int) -> None:
    layout, rows = Layout(image, text), 24
    for kind in ("image", "text"):
        covered = []
        for rank in layout.ranks(kind):
            start, _ = layout.owned(rank, rows)
            for ddp_rank, piece in layout.pieces(rank, rows):
                low, high = layout.block(ddp_rank, rows)
                assert low <= start + piece.start < start + piece.stop <= high  # inside that rank's rows
                covered += range(start + piece.start, start + piece.stop)
        assert covered == list(range(rows))
    # whole blocks (one piece per DDP rank) exactly when each group's size divides the processes
    assert layout.whole_blocks() == (image == text)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("multiple", [None, 8])
def test_a_pieces_captions_are_padded_as_a_batch_of_only_them(side: str, multiple: int | None) -> None:
    tokenizer = load_tokenizer("mm-lightning/demo-bert")
    tokenizer.padding_side = side
    captions = ["a red circle", "a small blue star in the top left on a gray background", "a cat", "green"]

    def tokenized(texts: list[str]) -> dict[str, torch.Tensor]:
        return dict(tokenizer(texts, padding="longest", pad_to_multiple_of=multiple, return_tensors="pt"))

    batch = tokenized(captions)
    for rows in (slice(0, 2), slice(2, 4)):
        longest = int(batch["attention_mask"][rows].sum(1).max())
        length = padded_length(longest, multiple, batch["input_ids"].shape[1])
        piece = caption_rows(batch, rows, length, side)
        alone = tokenized(captions[rows])
        assert piece.keys() == alone.keys()
        assert all(torch.equal(piece[key], alone[key]) for key in alone)
    # control: cut from the other side, the short rows lose their words
    wrong = caption_rows(batch, slice(2, 4), length, "left" if side == "right" else "right")
    assert not torch.equal(wrong["input_ids"], tokenized(captions[2:4])["input_ids"])
