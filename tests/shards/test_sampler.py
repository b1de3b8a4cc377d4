"""ShardOrderSampler: equal batches on every rank whatever the shard sizes, one stream per (seed, epoch) that any
number of ranks reads, exact weights, and a StatefulDataLoader that resumes mid-epoch on exactly the unseen
samples."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from mm_lightning.extras.shards.mixing import ShardOrderSampler, SourcePlan, epoch_counts

SIZES = (7, 3, 11, 5, 1, 9)  # 36 items in uneven shards


def ranks(plans: list[SourcePlan], world: int, epoch: int = 0, **kwargs: object) -> list[list[int]]:
    out = []
    for rank in range(world):
        sampler = ShardOrderSampler(plans, num_replicas=world, rank=rank, seed=3, **kwargs)  # type: ignore[arg-type]
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == len(sampler)
        out.append(order)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_rank_gets_the_same_count_and_no_item_twice(world: int) -> None:
    per_rank = ranks([SourcePlan(SIZES)], world)
    assert len({len(r) for r in per_rank}) == 1
    seen = [i for r in per_rank for i in r]
    assert len(seen) == len(set(seen))  # one pass: no duplicates
    assert 36 - len(seen) < world  # only the tail short of one step waits (batch_size 1)
    assert set(seen) <= set(range(36))


def test_each_step_reads_a_few_shards_and_ranks_split_it() -> None:
    starts = [0, 7, 10, 21, 26, 27]
    shard_of = {i: max(s for s, st in enumerate(starts) if st <= i) for i in range(36)}
    per_rank = ranks([SourcePlan(SIZES)], 2, shuffle_shards=1, batch_size=3)
    steps = [per_rank[0][b : b + 3] + per_rank[1][b : b + 3] for b in range(0, len(per_rank[0]), 3)]
    # One shard per window: a step's 6 items come from consecutive shards of the stream (3 at most here: the
    # 1- and 3-item shards fit inside a step), not from all 6.
    read = [shard_of[i] for step in steps for i in step]
    assert sum(a != b for a, b in zip(read, read[1:], strict=False)) == len(SIZES) - 1
    assert max(len({shard_of[i] for i in step}) for step in steps) <= 3
    (one,) = ranks([SourcePlan(SIZES)], 1, shuffle_shards=1, batch_size=6)
    assert [i for step in steps for i in step] == one  # 2 x 3 reads, step by step, what 1 x 6 reads


def test_order_is_a_function_of_seed_and_epoch() -> None:
    plans = [SourcePlan(SIZES)]
    assert ranks(plans, 2, epoch=1) == ranks(plans, 2, epoch=1)
    assert ranks(plans, 2, epoch=1) != ranks(plans, 2, epoch=2)  # control: a new epoch reshuffles
    assert sorted(sum(ranks(plans, 1, epoch=1), [])) == sorted(sum(ranks(plans, 1, epoch=2), []))


def test_shuffle_stays_within_windows_of_shards() -> None:
    # One shard per window: items of a shard come out contiguously (locality), in shuffled order.
    order = ranks([SourcePlan(SIZES)], 1, shuffle_shards=1)[0]
    starts = [0, 7, 10, 21, 26, 27, 36]
    blocks = [order[i : i + 1] for i in range(len(order))]
    shard = [next(s for s in range(6) if starts[s] <= b[0] < starts[s + 1]) for b in blocks]
    assert sum(a != b for a, b in zip(shard, shard[1:], strict=False)) == len(SIZES) - 1


def test_weights_upsample_and_subsample_exactly() -> None:
    plans = [SourcePlan((4, 6), weight=2.0), SourcePlan((5, 5, 2), weight=0.5, offset=10)]
    (order,) = ranks(plans, 1)
    counts = Counter(order)
    assert all(counts[i] == 2 for i in range(10))  # every item of source 0 twice
    second = [i for i in order if i >= 10]
    assert len(second) == 6 and len(set(second)) == 6  # half of source 1, no repeats
    # Interleaved, not concatenated.
    assert order[:12] != sorted(order[:12]) and any(i >= 10 for i in order[:10])


def test_two_ranks_mixing_counts_are_exact_per_source() -> None:
    plans = [SourcePlan((4, 6), weight=2.0), SourcePlan((5, 5, 2), weight=1.0, offset=10)]
    per_rank = ranks(plans, 2)
    for order in per_rank:
        assert sum(i < 10 for i in order) == 10 and sum(i >= 10 for i in order) == 6


def test_fixed_epoch_samples_resample_by_share() -> None:
    plans = [SourcePlan((3,), weight=1.0), SourcePlan((30,), weight=1.0, offset=3)]
    assert epoch_counts(plans, 22) == [2, 20]
    (order,) = ranks(plans, 1, epoch_samples=100)
    assert len(order) == 100
    assert Counter(i < 3 for i in order)[True] == 9  # 100 * 3/33, rounded by largest remainder


class Indices(Dataset):
    def __len__(self) -> int:
        return 36

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_loader_resumes_on_exactly_the_unseen_batches(num_workers: int) -> None:
    def loader() -> StatefulDataLoader:
        sampler = ShardOrderSampler([SourcePlan(SIZES)], num_replicas=2, rank=1, seed=5)
        sampler.set_epoch(4)
        return StatefulDataLoader(
            Indices(), sampler=sampler, batch_size=4, drop_last=True, num_workers=num_workers
        )

    full = [b.tolist() for b in loader()]
    first = loader()
    it = iter(first)
    seen = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert seen + rest == full and len(rest) == len(full) - 2
    assert [b.tolist() for b in loader()][2:] != full[:-2]  # control: a fresh loader starts over
    assert torch.tensor(full).numel() == 16  # 18 items per rank -> 4 full batches
