"""The source-independent pieces a second source (shards) reuses: SampleBuilder on bytes, RecordError through
pickling (errors travel from workers inside batches)."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from mm_lightning.data import MultimodalDataModule, Record, RecordError, SampleBuilder
from mm_lightning.data.records import record_errors
from mm_lightning.extras import ShardDataModule
from tests.data.helpers import natural_array


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(natural_array(20, 24)).save(buffer, format="PNG")
    return buffer.getvalue()


def _decode(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as img:
        return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()


def test_builder_decodes_bytes_and_names_the_shard_sample() -> None:
    builder = SampleBuilder(decode_bytes=_decode)
    good = Record(_png_bytes(), ["a photo"], "shard-00001.tar", sample="000042", image_name="000042.jpg")
    sample = builder(good, "a photo", image_id=7, index=3)
    assert sample["image"].shape == (3, 20, 24) and sample["index"] == 3 and sample["skipped"] == []
    bad = Record(
        b"<html>404</html>", ["a photo"], "shard-00001.tar", sample="000043", image_name="000043.jpg"
    )
    with pytest.raises(
        RecordError, match=r"^shard-00001.tar \[sample 000043\] \(image '000043.jpg'\)"
    ) as info:
        builder(bad, "a photo", 0, 0)
    assert info.value.kind == "undecodable_image"
    with pytest.raises(RecordError, match="no bytes decoder"):
        SampleBuilder()(good, "a photo", 0, 0)


@pytest.mark.parametrize("datamodule", [MultimodalDataModule, ShardDataModule])
def test_both_data_modules_apply_the_image_options_to_shard_bytes(datamodule: type) -> None:
    # One sample builder for JSONL files and shards: the decompression-bomb guard and the reduced decode the
    # user set reach shard members too (a copied builder for shards once dropped both).
    record = Record(_png_bytes(), ["a photo"], "shard-00001.tar", sample="000042", image_name="000042.jpg")
    guarded = datamodule(
        tokenizer="mm-lightning/demo-bert", images={"max_pixels": 400, "reduced_decode": False}
    )
    for split in ("train", "val"):
        builder = guarded.sample_builder(split)
        assert builder.transform.max_pixels == 400 and builder.transform.reduced_decode is False
        with pytest.raises(RecordError, match="above data.images.max_pixels=400") as info:
            builder(record, "a photo", 0, 0)
        assert info.value.kind == "undecodable_image"
    # control: with the default guard the same bytes build a sample
    sample = datamodule(tokenizer="mm-lightning/demo-bert").sample_builder("train")(record, "a photo", 0, 0)
    assert sample["image"].shape == (3, 224, 224)


def test_record_error_keeps_every_field_through_pickle() -> None:
    err = RecordError("f.jsonl", 3, "why", "a.jpg", kind="bad_path", key="image")
    back = pickle.loads(pickle.dumps(err))
    assert (back.file, back.line, back.reason, back.image, back.kind, back.key) == (
        "f.jsonl", 3, "why", "a.jpg", "bad_path", "image",
    )  # fmt: skip
    assert str(back) == str(err) == "f.jsonl:3 (key 'image') (image 'a.jpg'): why"


def test_record_errors_converts_everything_but_fatal_errors() -> None:
    with pytest.raises(RecordError, match=r"f:1: malformed JSON \(RecursionError: deep\)") as info:
        with record_errors("f", 1, "malformed_json", what="malformed JSON"):
            raise RecursionError("deep")
    assert info.value.kind == "malformed_json" and isinstance(info.value.__cause__, RecursionError)
    for fatal in (MemoryError, KeyboardInterrupt, SystemExit):
        with pytest.raises(fatal), record_errors("f", 1, "bad_path"):
            raise fatal()
