"""Leakage between splits: one image, or a near-copy of it, in two splits, and captions two splits share.

Near-copies are found with a perceptual hash, imagehash's ``phash``: the image in grayscale at 32 x 32, its DCT,
and the 8 x 8 lowest frequencies each above or below their median (64 bits; a test checks the bits equal
``imagehash.phash`` on the same thumbnail). Two differences make it fast enough to hash every image an audit reads:
a JPEG's luma is decoded at reduced size in the decoder (the smallest of its DCT scales at least 32 pixels on its
short side), and the mirrored image's hash comes from the same DCT (mirroring flips the sign of odd horizontal
frequencies), so a mirrored copy is caught without a second decode. Two images are near-copies when either hash
of one is within ``bits`` (Hamming distance) of the other's plain hash. What it catches on real photos, and its
speed: ``benchmarks/near_duplicates.py``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from mm_lightning.data.images import DCT_SCALES, EncodedImage, ImageDecodeError, orient

try:
    import simplejpeg
except ImportError:  # a dependency, but EncodedImage decodes without it too
    simplejpeg = None

HASH_INPUT = 32  # imagehash's DCT input side (hash_size 8 x highfreq_factor 4)
HASH_SIDE = 8
NEAR_COPY_BITS = 10  # the default: distinct photos of the benchmark's set were 14 bits apart or more
EXAMPLES = 10
# scipy.fftpack's DCT-II, unnormalized, as a matrix: what imagehash applies along each axis
_DCT = 2 * np.cos(np.pi * np.outer(np.arange(HASH_INPUT), 2 * np.arange(HASH_INPUT) + 1) / (2 * HASH_INPUT))
_MIRROR = (-1.0) ** np.arange(HASH_SIDE)  # a mirrored image's DCT: odd horizontal frequencies change sign


def _bits(low: np.ndarray) -> int:
    """imagehash's 64 bits, row by row, the first the most significant."""
    return int.from_bytes(np.packbits(low > np.median(low)).tobytes(), "big")


def thumbnail(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """The image as displayed (EXIF orientation applied), grayscale; a JPEG decoded at reduced size."""
    with EncodedImage(data, max_pixels=max_pixels) as encoded:  # checks the header and the size
        short = min(encoded.size)
        scale = max([s for s in DCT_SCALES if short // s >= HASH_INPUT] or [1]) if encoded.scalable else 1
        try:
            header = (
                simplejpeg.decode_jpeg_header(data) if encoded.is_jpeg and simplejpeg is not None else None
            )
        except ValueError:  # a header PIL reads but libjpeg-turbo does not: the general decode says why
            header = None
        if header is not None and header[2] in ("Gray", "YCbCr"):
            # the luma plane alone: no colour conversion (most of a reduced decode's time is the entropy decode)
            height, width = header[:2]
            try:
                gray = simplejpeg.decode_jpeg(
                    data, "GRAY", min_width=-(-width // scale), min_height=-(-height // scale)
                )
            except ValueError as err:
                raise ImageDecodeError(f"corrupt or truncated JPEG ({err})") from err
            pixels = orient(torch.from_numpy(gray).permute(2, 0, 1), encoded.orientation)[0]
            return Image.fromarray(pixels.numpy())
        return Image.fromarray(encoded.decode(scale).permute(1, 2, 0).numpy()).convert("L")


def perceptual_hashes(image: Image.Image) -> tuple[int, int]:
    """The image's ``phash`` and its mirrored image's, as 64-bit integers."""
    small = image.convert("L").resize((HASH_INPUT, HASH_INPUT), Image.Resampling.LANCZOS)
    low = (_DCT @ np.asarray(small, dtype=np.float64) @ _DCT.T)[:HASH_SIDE, :HASH_SIDE]
    return _bits(low), _bits(low * _MIRROR)


def image_hashes(data: bytes, max_pixels: int | None = None) -> tuple[int, int]:
    """:func:`perceptual_hashes` of an encoded image."""
    return perceptual_hashes(thumbnail(data, max_pixels))


def caption_key(caption: str) -> str:
    """A caption as compared across splits: case, spacing and a final full stop ignored."""
    return re.sub(r"\s+", " ", caption).strip().rstrip(".").strip().lower()


@dataclass
class SplitImages:
    """What leakage is looked for in, per split: each image's name (path, or shard and key), content digest and
    perceptual hashes, and the split's captions."""

    names: list[str] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    mirrored: list[int] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)

    def add(self, name: str, digest: str, hashes: tuple[int, int]) -> None:
        self.names.append(name)
        self.digests.append(digest)
        self.hashes.append(hashes[0])
        self.mirrored.append(hashes[1])


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(b), len(a)) bit differences of 64-bit hashes."""
    return np.bitwise_count(b[:, None] ^ a[None, :])


def near_copies(
    earlier: SplitImages, later: SplitImages, bits: int, elements: int = 1 << 22
) -> list[tuple[int, int, int]]:
    """(earlier image, later image, distance) of each later image's nearest earlier image within ``bits``,
    plain or mirrored; ``elements`` bounds each block of distances (32 MB at 64 bits each)."""
    plain, mirrored = (np.array(v, dtype=np.uint64) for v in (earlier.hashes, earlier.mirrored))
    theirs = np.array(later.hashes, dtype=np.uint64)
    found = []
    if len(plain) == 0:
        return found
    chunk = max(1, elements // len(plain))
    for start in range(0, len(theirs), chunk):
        rows = theirs[start : start + chunk]
        distance = np.minimum(hamming(plain, rows), hamming(mirrored, rows))
        nearest = distance.argmin(1)
        close = distance[np.arange(len(rows)), nearest]
        for row in np.flatnonzero(close <= bits):
            found.append((int(nearest[row]), start + int(row), int(close[row])))
    return found


def pair_report(earlier: SplitImages, later: SplitImages, bits: int) -> dict[str, object]:
    """Images of ``later`` found in ``earlier`` (by path, by content under another name, as a near-copy), each
    named, and the captions both hold, counted, with examples."""
    paths = {name: i for i, name in enumerate(earlier.names)}
    contents = {digest: i for i, digest in enumerate(earlier.digests)}
    same_path, same_content, seen = [], [], set()
    for j, (name, digest) in enumerate(zip(later.names, later.digests, strict=True)):
        if name in paths:
            same_path.append(name)
            seen.add(j)
        elif digest in contents:
            same_content.append([earlier.names[contents[digest]], name])
            seen.add(j)
    near = [
        [earlier.names[i], later.names[j], d]
        for i, j, d in near_copies(earlier, later, bits)
        if j not in seen
    ]
    ours = {caption_key(c) for c in earlier.captions}
    shared = sorted({caption_key(c) for c in later.captions} & ours)
    return {
        "same_path": len(same_path),
        "same_content": len(same_content),
        "near_copies": len(near),
        "images_leaked": len(same_path) + len(same_content) + len(near),
        "same_captions": len(shared),
        # every leaked image, to take out of the later split; [earlier, later] and [earlier, later, bits apart]
        "leaked_images": {
            "same_path": same_path,
            "same_content": same_content,
            "near_copies": sorted(near, key=lambda n: n[2]),
        },
        "same_caption_examples": shared[:EXAMPLES],
    }


def leakage_report(splits: dict[str, SplitImages], bits: int = NEAR_COPY_BITS) -> dict[str, object]:
    """Every pair of splits, in the order given (``train/test``: images of test found in train); the totals are
    sums over the pairs (an image leaked from two earlier splits counts twice)."""
    pairs = {
        f"{a}/{b}": pair_report(splits[a], splits[b], bits) for a, b in itertools.combinations(splits, 2)
    }
    return {
        "near_copy_bits": bits,
        "pairs": pairs,
        "images_leaked": sum(p["images_leaked"] for p in pairs.values()),
        "same_captions": sum(p["same_captions"] for p in pairs.values()),
    }
