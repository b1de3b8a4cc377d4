"""The collate in a DataLoader worker fills its batch in shared memory (the images in one segment, everything
else in another), with the same values as in the main process."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from mm_lightning.data.collate import MultimodalCollate
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


class _Shared:
    """Collates a batch and reports whether its images were built in shared memory (picklable for workers)."""

    def __init__(self, collate: MultimodalCollate) -> None:
        self.collate = collate

    def __call__(self, samples: list[dict]) -> tuple[dict, bool, int]:
        batch = self.collate(samples)
        small = {
            v.untyped_storage().data_ptr() for k, v in batch.items() if k != "image" and torch.is_tensor(v)
        }
        return batch, batch["image"].is_shared(), len(small)


def test_worker_batches_are_built_in_shared_memory_with_in_process_values() -> None:
    for normalize in (None, Normalize()):
        collate = MultimodalCollate(TOKENIZER, normalize=normalize)
        reference = collate(_samples())
        # control: in the main process the batch is ordinary memory
        assert not reference["image"].is_shared()
        loader = DataLoader(_samples(), batch_size=4, num_workers=1, collate_fn=_Shared(collate))
        (batch, shared_in_worker, small_segments) = next(iter(loader))
        assert shared_in_worker  # filled in a segment, not copied into one on the way out
        assert small_segments == 1  # ids, masks, indices: one segment (one descriptor to hand over)
        assert batch["image"].dtype == (torch.uint8 if normalize is None else torch.float32)
        assert batch.keys() == reference.keys()
        for key, value in reference.items():
            if torch.is_tensor(value):
                assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key
        # control: in the main process each small tensor has its own storage
        assert (
            len(
                {
                    v.untyped_storage().data_ptr()
                    for k, v in reference.items()
                    if k != "image" and torch.is_tensor(v)
                }
            )
            > 1
        )
