"""Image batches in reusable shared-memory slots: the values of the in-process collate, a slot reused only once
every tensor over it is gone (batches kept by the user stay intact), discarded batches hand their slots back."""

from __future__ import annotations

import gc
import multiprocessing
import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from mm_lightning.data.batch_slots import FREE, BatchSlots, SlotImages, slots_for
from mm_lightning.data.collate import MultimodalCollate
from mm_lightning.data.config import LoaderOptions
from mm_lightning.data.transforms import Normalize
from tests.data.helpers import TOKENIZER

BATCH, SIDE = 4, 16


def _samples(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "image": torch.randint(0, 256, (3, SIDE, SIDE), dtype=torch.uint8, generator=gen),
            "caption": f"a photo of {i} cats on a mat",
            "image_id": i,
            "index": i,
        }
        for i in range(n)
    ]


def _loader(samples: list[dict], slots: BatchSlots | None) -> DataLoader:
    collate = MultimodalCollate(TOKENIZER).for_queue(slots)
    return DataLoader(
        samples,
        batch_size=BATCH,
        num_workers=2,
        persistent_workers=True,
        prefetch_factor=2,
        collate_fn=collate,
        multiprocessing_context="fork",
    )


def _held_batches_match(samples: list[dict], slots: BatchSlots) -> tuple[bool, int]:
    """Keep every batch of an epoch (more than there are slots), then compare each with the in-process collate."""
    reference = MultimodalCollate(TOKENIZER)
    held = list(_loader(samples, slots))
    in_slots = sum(slots.owns(batch["image"]) for batch in held)
    same = all(
        torch.equal(batch["image"], reference(samples[k * BATCH : (k + 1) * BATCH])["image"])
        and batch["index"].tolist() == list(range(k * BATCH, (k + 1) * BATCH))
        for k, batch in enumerate(held)
    )
    return same, in_slots


@pytest.mark.timeout(120)
def test_kept_batches_stay_intact_and_slots_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = _samples(12 * BATCH)  # 6 batches per worker, 3 slots per worker
    slots = BatchSlots(2, 3, (BATCH, 3, SIDE, SIDE))
    same, in_slots = _held_batches_match(samples, slots)
    assert same
    # the first 3 batches of each worker are in slots; then all are held, and the workers fall back
    assert in_slots == 6

    # control: a lease that frees its slot at once lets a worker overwrite batches still held, and that is seen
    def eager(self: BatchSlots, slot: int, rows: int) -> torch.Tensor:
        tensor = self.pixels[slot, :rows]
        self._flags_np[slot] = FREE
        return tensor

    monkeypatch.setattr(BatchSlots, "lease", eager)
    same, in_slots = _held_batches_match(samples, BatchSlots(2, 3, (BATCH, 3, SIDE, SIDE)))
    assert in_slots == 12 and not same  # every batch in a slot, earlier ones overwritten


@pytest.mark.timeout(120)
def test_discarded_and_dropped_batches_hand_their_slots_back() -> None:
    samples = _samples(16 * BATCH)
    slots = BatchSlots(2, 4, (BATCH, 3, SIDE, SIDE))
    loader = _loader(samples, slots)
    reference = MultimodalCollate(TOKENIZER)
    for _ in range(5):  # leave each epoch after one batch: the batches prepared ahead are discarded
        batch = next(iter(loader))
        assert slots.owns(batch["image"])  # would fall back for good if discarded batches kept their slots
        assert torch.equal(batch["image"], reference(samples[:BATCH])["image"])
    for batch in loader:  # a whole epoch, one batch alive at a time
        assert slots.owns(batch["image"])
    view = batch["image"][1:]  # a view keeps the slot held
    del batch
    gc.collect()
    assert slots.free_slots() == 2 * 4 - 1
    del view
    gc.collect()
    assert slots.free_slots() == 2 * 4


def test_no_slots_outside_workers_or_without_persistent_workers() -> None:
    slots = BatchSlots(1, 2, (BATCH, 3, SIDE, SIDE))
    assert slots.reserve(BATCH, (3, SIDE, SIDE), torch.uint8) is None  # main process: nothing crosses a queue
    batch = MultimodalCollate(TOKENIZER).for_queue(slots)(_samples(BATCH))
    assert torch.is_tensor(batch["image"]) and not slots.owns(batch["image"])
    loader = LoaderOptions(persistent_workers=False)
    assert slots_for(2, 4, SIDE, loader, normalized=False) is None  # workers restarted every epoch: no slots
    loader = LoaderOptions(persistent_workers=True)
    made = slots_for(2, 4, SIDE, loader, normalized=False)
    assert made is not None and made.shape == (4, 3, SIDE, SIDE) and made.per_worker == 4
    assert made.dtype == torch.uint8 and slots_for(2, 4, SIDE, loader, normalized=True).dtype == torch.float32


@pytest.mark.timeout(120)
def test_workers_fill_slots_only_with_their_shape_and_dtype() -> None:
    samples = _samples(4 * BATCH)
    normalize = Normalize()
    reference = MultimodalCollate(TOKENIZER, normalize=normalize)
    for shape, dtype, expected in [
        ((BATCH, 3, SIDE, SIDE), torch.float32, True),  # normalized in the workers: float32 slots
        ((BATCH, 3, SIDE, SIDE), torch.uint8, False),  # control: uint8 slots do not take float images
        ((BATCH, 3, SIDE + 1, SIDE), torch.float32, False),  # control: another image size
    ]:
        slots = BatchSlots(2, 2, shape, dtype)
        collate = MultimodalCollate(TOKENIZER, normalize=normalize).for_queue(slots)
        loader = DataLoader(samples, batch_size=BATCH, num_workers=2, collate_fn=collate)
        batches = list(loader)
        assert all(slots.owns(b["image"]) == expected for b in batches), (shape, dtype)
        for k, batch in enumerate(batches):
            assert torch.equal(batch["image"], reference(samples[k * BATCH : (k + 1) * BATCH])["image"])


def test_a_slot_batch_from_a_loader_this_process_does_not_own_is_refused() -> None:
    blob = pickle.dumps({"image": SlotImages("not-a-loader-of-this-process", 0, 4)})
    with pytest.raises(RuntimeError, match="shared batch slots this process does not own"):
        pickle.loads(blob)


def _iterate_in_a_child(slots: BatchSlots, samples: list[dict], results: multiprocessing.Queue) -> None:
    batches = list(_loader(samples, slots))  # this process's workers; the slots' maker is the parent
    results.put((any(slots.owns(b["image"]) for b in batches), slots.free_slots(), len(batches)))


@pytest.mark.timeout(120)
def test_a_copy_of_the_loader_in_another_process_does_not_fill_the_slots() -> None:
    samples = _samples(4 * BATCH)
    slots = BatchSlots(2, 2, (BATCH, 3, SIDE, SIDE))
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_iterate_in_a_child, args=(slots, samples, results))
    child.start()
    in_slots, free, n = results.get(timeout=100)
    child.join(timeout=30)
    assert n == 4 and not in_slots and free == 4  # fell back: the parent's workers could be writing them
    # control: the maker's own workers do fill them
    assert all(slots.owns(b["image"]) for b in _loader(samples, slots))
