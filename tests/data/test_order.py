"""The training order: one stream per epoch that any number of ranks reads by position, positions saved as sample
counts that a loader on another number of ranks resumes each sample once, and draws seeded per visit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from mm_lightning.data import MultimodalDataModule
from mm_lightning.data.order import GlobalOrderSampler, Visit
from mm_lightning.data.resume import ResumableDataLoader, ResumeError
from mm_lightning.extras import LengthGroupedSampler
from mm_lightning.extras.shards.mixing import ShardOrderSampler, SourcePlan
from tests.data.helpers import TOKENIZER, coco_style

SIZE = 96  # divisible by every global batch below: an epoch ends without a tail


def loaders(world: int, batch: int, sampler_of: Any = None, epoch: int = 0) -> list[ResumableDataLoader]:
    """One train loader per rank of ``world`` over the indices ``0..SIZE-1``."""
    out = []
    for rank in range(world):
        sampler = (sampler_of or GlobalOrderSampler)(SIZE, batch, num_replicas=world, rank=rank, seed=5)
        sampler.set_epoch(epoch)
        out.append(ResumableDataLoader(list(range(SIZE)), sampler, batch_size=batch))
    return out


def read(ranks: list[ResumableDataLoader], steps: int | None = None) -> list[list[int]]:
    """Each global step's samples, ranks in order (how the contrastive loss gathers them)."""
    iterators = [iter(loader) for loader in ranks]
    out = []
    while steps is None or len(out) < steps:
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            assert all(b is None for b in batches)  # every rank ends at the same step
            return out
        out.append([i for b in batches for i in b.tolist()])
    return out


def resumed(state: dict, world: int, batch: int, sampler_of: Any = None) -> list[ResumableDataLoader]:
    ranks = loaders(world, batch, sampler_of)
    for loader in ranks:
        loader.load_position(state)
    return ranks


def test_a_loader_passed_to_fit_resumes_mid_epoch_only_on_the_global_batch_that_saved_it() -> None:
    """Lightning's copy of the position (a loader no data module keeps): its batch counters stay in the saved
    layout, so another global batch mid-epoch is refused; the same global batch resumes."""
    before = loaders(2, 4)
    read(before, steps=3)
    state = before[0].state_dict()  # what Lightning saves for a loader passed to fit
    assert state == before[0].position_state()
    same_global_batch = loaders(1, 8)[0]
    same_global_batch.load_state_dict(state)
    assert same_global_batch.position() == (0, 24)
    with pytest.raises(ResumeError, match="resume through such a data module"):
        loaders(1, 4)[0].load_state_dict(state)
    kept = loaders(1, 4)[0]  # control: the data module's path counts the epoch in the new layout
    kept.load_position(state)
    assert kept.position() == (0, 24)
    kept.kept_by_data_module = True
    assert kept.state_dict() == {}  # the position is held once: Lightning's copy stays empty


@pytest.mark.parametrize(("world", "batch"), [(2, 4), (4, 2), (8, 1)])
def test_ranks_read_the_steps_one_process_reads(world: int, batch: int) -> None:
    assert read(loaders(world, batch)) == read(loaders(1, 8))  # 2 x 4 reads the batches 1 x 8 reads, in order
    assert read(loaders(world, batch, epoch=1)) != read(loaders(1, 8))  # control: a new epoch, a new order


@pytest.mark.parametrize("after", [(1, 8), (3, 4), (3, 8), (4, 6)])
def test_a_resume_on_another_layout_reads_the_rest_of_the_epoch_once(after: tuple[int, int]) -> None:
    before = loaders(2, 4)
    seen = sum(read(before, steps=6), [])  # 6 steps of 2 x 4 = 48 samples
    state = before[0].position_state()
    assert state == before[1].position_state()  # the position is the epoch's, not a rank's
    assert state[ResumableDataLoader.KEY]["consumed"] == 48
    rest = sum(read(resumed(state, *after)), [])
    assert Counter(seen + rest) == Counter(range(SIZE))  # each sample of the epoch once
    assert seen + rest == sum(read(loaders(1, 8)), [])  # in the epoch's own order

    if after[0] * after[1] == 8:
        return  # the same global batch: a per-process batch count names the same position
    # Control: a position kept as each process's batch count (what per-rank loader states give) repeats or
    # skips samples once the global batch changes.
    key = ResumableDataLoader.KEY
    per_process = {
        key: {**state[key], "consumed": 6 * after[0] * after[1]}
    }  # 6 steps of the new global batch
    counted = sum(read(resumed(per_process, *after)), [])
    assert Counter(seen + counted) != Counter(range(SIZE))


def test_an_epoch_end_position_starts_the_next_epoch_on_any_layout() -> None:
    before = loaders(2, 4)
    read(before)
    state = before[0].position_state()
    next_epoch = read(resumed(state, 3, 4))
    ranks = loaders(3, 4, epoch=1)
    assert next_epoch == read(ranks) and len(next_epoch) == SIZE // 12


def test_a_loader_state_without_a_position_is_refused() -> None:
    # what a per-process loader (torchdata's StatefulDataLoader) saves: a batch count, no position of the epoch
    with pytest.raises(ResumeError, match="where the epoch stopped is unknown"):
        resumed({"_num_yielded": 6, "_iterator_finished": False}, 1, 8)
    read(resumed(loaders(1, 8)[0].position_state(), 1, 8))  # control: a position this loader saved


def test_loading_a_position_twice_changes_nothing() -> None:
    before = loaders(2, 4)
    read(before, steps=3)
    state = before[0].position_state()
    (once,) = resumed(state, 1, 8)
    (twice,) = resumed(state, 1, 8)
    twice.load_position(state)
    assert read([once]) == read([twice])
    assert twice.position_state()[ResumableDataLoader.KEY]["layouts"] == [
        {"epoch": 0, "consumed": 24, "world_size": 1, "batch_size": 8}
    ]


def test_workers_read_the_same_stream_and_save_the_same_position() -> None:
    ranks = loaders(2, 4)
    with_workers = []
    for rank in range(2):
        sampler = GlobalOrderSampler(SIZE, 4, num_replicas=2, rank=rank, seed=5)
        with_workers.append(ResumableDataLoader(list(range(SIZE)), sampler, batch_size=4, num_workers=2))
    assert read(with_workers, steps=3) == read(ranks, steps=3)
    assert with_workers[0].position_state() == ranks[0].position_state()  # prefetched batches are not counted


def length_grouped(size: int, batch: int, num_replicas: int = 1, rank: int = 0, seed: int = 0) -> Any:
    lengths = torch.randint(1, 40, (size,), generator=torch.Generator().manual_seed(1)).numpy()
    return LengthGroupedSampler(lengths, batch, num_replicas, rank, seed, window_batches=4)


def test_length_groups_resume_on_other_processes_but_not_another_batch_size() -> None:
    before = loaders(2, 4, length_grouped)
    seen = sum(read(before, steps=3), [])
    state = before[0].position_state()
    rest = sum(read(resumed(state, 3, 4, length_grouped)), [])
    assert Counter(seen + rest) == Counter(range(SIZE))
    with pytest.raises(ResumeError, match="data.batch_size 4"):
        resumed(state, 1, 8, length_grouped)  # its groups are batches: another size is another order


def mixture(size: int, batch: int, num_replicas: int = 1, rank: int = 0, seed: int = 0) -> ShardOrderSampler:
    """Two sources of 48 items in uneven shards, the second upsampled twice: 144 visits per epoch."""
    plans = [SourcePlan((20, 8, 13, 7)), SourcePlan((30, 18), weight=2.0, offset=48)]
    return ShardOrderSampler(plans, num_replicas, rank, seed, shuffle_shards=2, batch_size=batch)


def test_a_two_source_mixture_resumes_on_other_processes_with_its_exact_counts() -> None:
    full = sum(read(loaders(1, 12, mixture)), [])
    expected = Counter({**dict.fromkeys(range(48), 1), **dict.fromkeys(range(48, 96), 2)})
    assert Counter(full) == expected and len(full) == 144
    for after in [(1, 12), (3, 4), (3, 2)]:
        before = loaders(2, 6, mixture)
        seen = sum(read(before, steps=5), [])
        rest = sum(read(resumed(before[0].position_state(), *after, mixture)), [])
        assert seen + rest == full  # the rest of the same stream, each visit once


def test_a_sample_looks_the_same_whichever_rank_reads_it(tmp_path: Path) -> None:
    dm = MultimodalDataModule(
        train_file=str(coco_style(tmp_path, num_images=8, captions_per_image=4, size=(80, 60))),
        tokenizer=TOKENIZER,
        batch_size=2,
        images={"size": 24, "train_scale": (0.2, 1.0)},
        loader={"caption_sampling": "random"},
    )
    dm.setup("fit")
    dataset = dm.datasets["train"]

    def samples(world: int, batch: int, epoch: int = 0) -> dict[int, dict]:
        out = {}
        for rank in range(world):
            sampler = GlobalOrderSampler(len(dataset), batch, num_replicas=world, rank=rank, seed=5)
            sampler.set_epoch(epoch)
            for visit in sampler:
                (sample,) = dataset.__getitems__([visit])
                out[visit.position] = sample
        return out

    one, two = samples(1, 4), samples(2, 2)
    assert one.keys() == two.keys() == set(range(8))
    for position, sample in one.items():
        assert sample["caption"] == two[position]["caption"] and sample["index"] == two[position]["index"]
        assert torch.equal(sample["image"], two[position]["image"])
    # Control: another epoch's visits draw other crops and captions.
    other = samples(1, 4, epoch=1)
    by_index = {s["index"]: s for s in other.values()}
    assert any(not torch.equal(s["image"], by_index[s["index"]]["image"]) for s in one.values())


def test_a_visit_survives_the_trip_to_a_worker() -> None:
    import pickle

    visit = pickle.loads(pickle.dumps(Visit(7, 2, 31)))
    assert (int(visit), visit.epoch, visit.position) == (7, 2, 31) and isinstance(visit, Visit)


# The order's property, without processes: for each kind of stream, every layout before and after a kill (processes
# x batch size) and every kill point of the epoch, the resumed run reads the rest of the epoch's stream, each visit
# once (a run that changes its global batch mid-epoch leaves a tail shorter than one global batch).
STREAMS = {  # kind -> (sampler, batch sizes, the stream's order follows the batch size)
    "jsonl": (None, (2, 4), False),
    "length_grouping": (length_grouped, (2, 4), True),
    "two_source_mixture": (mixture, (2, 3), False),
}
WORLDS = (1, 2, 3, 4, 8)


def reads_the_rest_once(seen: list[int], rest: list[int], stream: list[int], global_batch_after: int) -> bool:
    """The epoch's stream in order, each visit once; only a tail short of the new global batch is left unread."""
    read_so_far = seen + rest
    return read_so_far == stream[: len(read_so_far)] and len(stream) - len(read_so_far) < global_batch_after


def resume_reads(
    state: dict, world: int, batch: int, sampler_of: Any, seen: list[int], stream: list[int]
) -> list:
    """What ``world`` x ``batch`` loaders resumed from ``state`` read of the epoch, as Lightning reads it: the
    layout's steps left in the epoch, by count."""
    left = (len(stream) - len(seen)) // (world * batch)
    return sum(read(resumed(state, world, batch, sampler_of), steps=left), [])


def epoch_stream(kind: str, batch: int) -> list[int]:
    sampler_of, _, _ = STREAMS[kind]
    return sum(read(loaders(1, batch, sampler_of)), [])


@pytest.mark.parametrize("kind", list(STREAMS))
def test_every_visit_is_read_once_across_a_resume_on_any_layout(kind: str) -> None:
    sampler_of, batches, follows_batch = STREAMS[kind]
    checked = 0
    for batch_before in batches:
        stream = epoch_stream(kind, batch_before)
        for world_before in WORLDS:
            before = read(loaders(world_before, batch_before, sampler_of))
            for kill in range(1, len(before)):  # after every step but the epoch's last
                ranks = loaders(world_before, batch_before, sampler_of)
                seen = sum(read(ranks, steps=kill), [])
                state = ranks[0].position_state()
                for world_after in WORLDS:
                    for batch_after in (batch_before,) if follows_batch else batches:
                        rest = resume_reads(state, world_after, batch_after, sampler_of, seen, stream)
                        case = (kind, world_before, batch_before, kill, world_after, batch_after)
                        assert reads_the_rest_once(seen, rest, stream, world_after * batch_after), case
                        checked += 1
    assert checked > 500


@pytest.mark.parametrize(("world_after", "batch_after"), [(8, 3), (1, 2)])
def test_control_a_position_kept_per_rank_skips_or_repeats_visits(world_after: int, batch_after: int) -> None:
    stream = epoch_stream("two_source_mixture", 3)
    ranks = loaders(2, 3, mixture)
    seen = sum(read(ranks, steps=4), [])
    state = ranks[0].position_state()
    rest = resume_reads(state, world_after, batch_after, mixture, seen, stream)
    assert reads_the_rest_once(seen, rest, stream, world_after * batch_after)  # the global position
    key = ResumableDataLoader.KEY
    # 4 steps of the new global batch: past the 24 samples read (8 x 3), or short of them (1 x 2)
    per_rank = {key: {**state[key], "consumed": 4 * world_after * batch_after}}
    rest = resume_reads(per_rank, world_after, batch_after, mixture, seen, stream)
    assert not reads_the_rest_once(seen, rest, stream, world_after * batch_after)


def test_groups_that_each_read_the_whole_batch_record_the_runs_layout() -> None:
    """A strategy that gives each group of processes the whole global batch (1 image + 2 text processes, one
    group per tower): every process records the run's layout, 3 x 4, so a resume on the same split changes no
    layout on either group (and the same global batch under DDP on 3 processes reads it as its own)."""

    def group(readers: int, processes: int | None) -> list[ResumableDataLoader]:
        samplers = [
            GlobalOrderSampler(SIZE, 12 // readers, num_replicas=readers, rank=r, seed=5)
            for r in range(readers)
        ]
        return [
            ResumableDataLoader(list(range(SIZE)), s, processes, batch_size=12 // readers) for s in samplers
        ]

    image, text = group(1, 3), group(2, 3)
    assert read(image, steps=2) == read(text, steps=2)  # both groups read the same global batches
    states = [loader.position_state()[ResumableDataLoader.KEY] for loader in image + text]
    # the same position and layout on every process; each records its own readers' batch (an order cut into
    # batches follows it)
    assert [state.pop("reader_batch_size") for state in states] == [12, 6, 6]
    assert all(state == states[0] for state in states)
    assert states[0] == {
        "epoch": 0, "consumed": 24, "stream_length": SIZE, "world_size": 3, "batch_size": 4, "layouts": [],
    }  # fmt: skip
    saved = text[0].position_state()
    for loaders_ in (group(1, 3), group(2, 3), loaders(3, 4)):
        for loader in loaders_:
            loader.load_position(saved)
            assert loader.layouts == []  # no layout change on any process
    # control: each group's own readers as the layout, the two groups record different ones
    image, text = group(1, None), group(2, None)
    assert image[0].position_state() != text[0].position_state()
    text[0].load_position(image[0].position_state())
    assert text[0].layouts != []
