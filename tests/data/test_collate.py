"""The collate in a DataLoader worker fills its images in shared memory and sends ids, masks and indices inside
the pickle, with the same values as in the main process."""

from __future__ import annotations

import pickle

import torch
from torch.utils.data import DataLoader

from mm_lightning.data.collate import ByValue, MultimodalCollate
from mm_lightning.data.transforms import Normalize
from tests.data.helpers import TOKENIZER


def _samples(n: int = 4) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "image": torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=gen),
            "caption": f"a photo of {i} cats on a mat",
            "image_id": i,
            "index": i,
        }
        for i in range(n)
    ]


class _Built:
    """Collates a batch in the worker and reports how it was built there (picklable for workers)."""

    def __init__(self, collate: MultimodalCollate) -> None:
        self.collate = collate

    def __call__(self, samples: list[dict]) -> tuple[dict, bool, list[str]]:
        batch = self.collate(samples)
        by_value = sorted(k for k, v in batch.items() if isinstance(v, ByValue))
        return batch, batch["image"].is_shared(), by_value


def test_worker_batches_cross_the_queue_cheaply_with_in_process_values() -> None:
    for normalize in (None, Normalize()):
        collate = MultimodalCollate(TOKENIZER, normalize=normalize)
        reference = collate(_samples())
        small = sorted(k for k, v in reference.items() if torch.is_tensor(v) and k != "image")
        # control: in the main process the batch is ordinary memory
        assert not reference["image"].is_shared()
        loader = DataLoader(_samples(), batch_size=4, num_workers=1, collate_fn=_Built(collate.for_queue()))
        (batch, shared_in_worker, by_value) = next(iter(loader))
        assert shared_in_worker  # filled in a segment, not copied into one on the way out
        assert by_value == small and len(small) >= 5  # ids, masks, indices: in the pickle, no segment each
        assert batch["image"].dtype == (torch.uint8 if normalize is None else torch.float32)
        assert batch.keys() == reference.keys()
        for key, value in reference.items():
            if torch.is_tensor(value):
                assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key
        assert not any(batch[k].is_shared() for k in small)
        batch["input_ids"][0, 0] = 7  # an ordinary, writable tensor in the main process
        # control: a collate not made for the queue hands each small tensor over in shared memory
        plain = next(iter(DataLoader(_samples(), batch_size=4, num_workers=1, collate_fn=collate)))
        assert all(plain[k].is_shared() for k in small)


def test_by_value_round_trips_every_dtype_and_empty_tensors() -> None:
    for tensor in (
        torch.arange(6).reshape(2, 3),
        torch.tensor([True, False]),
        torch.zeros(0, 4, dtype=torch.long),
        torch.arange(8).reshape(2, 4)[:, ::2],  # not contiguous
    ):
        back = pickle.loads(pickle.dumps(ByValue(tensor)))
        assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
