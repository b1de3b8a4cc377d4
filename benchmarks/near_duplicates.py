"""Which perceptual hash finds a test image that is a copy of a training image: recall, false matches and speed.

Every photo of the dev set (239 COCO photos) gets copies as a leak would bring them: re-encoded at JPEG quality 30,
resized to half its sides, 10 % cut away (5 % at each side, or 10 % of each side at one corner), mirrored. Each
hash of ``imagehash`` is computed from the file: the JPEG decoded at reduced size (PIL's ``draft``, which scales in
the JPEG decoder) or in full, then the library's own hash; a mirrored copy is matched by also hashing the mirrored
thumbnail (the smaller of the two Hamming distances counts). The audit's own (``mm_lightning.commands.leakage``)
gives phash's bits from one reduced decode, the mirrored hash from the same DCT. For each hash the
threshold is the largest Hamming distance at which no two distinct photos match (of 28,441 pairs); at it, the share
of each kind of copy found, and the images hashed per second in one process (the best of 3 passes).

    python benchmarks/near_duplicates.py
    python benchmarks/near_duplicates.py --photos DIR      # any folder of JPEGs (searched recursively)
    python benchmarks/near_duplicates.py --quick   # seconds: the same path on 10 photos derived from bundled ones

The last line is ``RESULT near_duplicates images_per_s=<the chosen hash's images per second, one process>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import imagehash
import numpy as np
from PIL import Image
from support.real_photos import PHOTO_SETS, build

from mm_lightning.commands.leakage import NEAR_COPY_BITS, image_hashes

DEV_PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "devdata" / "coco_mini" / "images"
THUMBNAIL = 64  # the decoder's reduced size: >= twice imagehash's 32-pixel DCT input


def copies(image: Image.Image) -> dict[str, bytes]:
    """The kinds of copy a leak brings, each encoded as a JPEG file would be."""
    width, height = image.size
    cut_w, cut_h = width // 20, height // 20
    kinds = {
        "jpeg_q30": (image, 30),
        "half_size": (image.resize((width // 2, height // 2), Image.Resampling.BICUBIC), 90),
        "crop_10pct_centred": (image.crop((cut_w, cut_h, width - cut_w, height - cut_h)), 90),
        "crop_10pct_corner": (image.crop((2 * cut_w, 2 * cut_h, width, height)), 90),
        "mirrored": (image.transpose(Image.Transpose.FLIP_LEFT_RIGHT), 90),
    }
    out = {}
    for kind, (copy, quality) in kinds.items():
        buffer = io.BytesIO()
        copy.save(buffer, "JPEG", quality=quality)
        out[kind] = buffer.getvalue()
    return out


def hasher(method: Callable, draft: bool) -> Callable[[bytes], tuple[int, int]]:
    """File bytes -> (hash, hash of the mirrored image) as 64-bit integers."""

    def run(data: bytes) -> tuple[int, int]:
        with Image.open(io.BytesIO(data)) as image:
            if draft:
                image.draft("RGB", (THUMBNAIL, THUMBNAIL))
            image = image.convert("RGB")
            if draft:
                image.thumbnail((THUMBNAIL, THUMBNAIL))
            values = [method(image), method(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT))]
        return tuple(int(str(v), 16) for v in values)  # type: ignore[return-value]

    return run


METHODS = {
    "phash, full decode": hasher(imagehash.phash, draft=False),
    "phash, reduced decode": hasher(imagehash.phash, draft=True),
    "dhash, reduced decode": hasher(imagehash.dhash, draft=True),
    "average_hash, reduced decode": hasher(imagehash.average_hash, draft=True),
    "whash, reduced decode": hasher(imagehash.whash, draft=True),
    # the audit's: phash's bits, one reduced decode (simplejpeg), the mirrored hash from the same DCT
    "phash, the audit's": image_hashes,
}


def distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    """Hamming distance of ``b`` to ``a`` or to ``a`` mirrored, whichever is smaller."""
    return min((a[0] ^ b[0]).bit_count(), (a[1] ^ b[0]).bit_count())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=Path, default=DEV_PHOTOS, help="a folder of JPEG photos")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the same path in seconds on 10 photos derived from scikit-image's, in a fresh temporary folder",
    )
    args = parser.parse_args()
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="mm_lightning_near_duplicates_") as scratch:
            args.photos = build(Path(scratch), dataclasses.replace(PHOTO_SETS["coco"], count=10)).parent
            run(args)
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    files = sorted(args.photos.rglob("*.jpg"))
    originals = [f.read_bytes() for f in files]
    planted = []
    for data in originals:
        with Image.open(io.BytesIO(data)) as image:
            planted.append(copies(image.convert("RGB")))
    kinds = list(planted[0])
    print(
        f"{len(files)} photos, {len(kinds)} kinds of copy each; {len(files) * (len(files) - 1) // 2} distinct pairs"
    )
    chosen = None
    for name, run in METHODS.items():
        seconds = []
        for _ in range(3):  # the best of 3 passes: a warm process, as an audit of many images is
            start = time.perf_counter()
            hashes = [run(data) for data in originals]
            seconds.append(time.perf_counter() - start)
        per_second = len(originals) / min(seconds)
        distinct = min(distance(a, b) for a, b in itertools.combinations(hashes, 2))
        threshold = distinct - 1  # the largest distance at which no two distinct photos match
        own = {}
        for kind in kinds:
            copy_hashes = [run(p[kind]) for p in planted]
            own[kind] = np.array([distance(h, c) for h, c in zip(hashes, copy_hashes, strict=True)])
        cells = ", ".join(f"{kind} {100 * (d <= threshold).mean():.0f} %" for kind, d in own.items())
        print(f"{name}: {per_second:.0f} images/s; distinct photos >= {distinct} bits apart, threshold {threshold};"
              f" found: {cells}", flush=True)  # fmt: skip
        if name == "phash, the audit's":
            chosen = per_second
            for bits in sorted({8, NEAR_COPY_BITS, 12}):
                cells = ", ".join(f"{kind} {100 * (d <= bits).mean():.0f} %" for kind, d in own.items())
                print(f"  at {bits} bits{' (the default)' if bits == NEAR_COPY_BITS else ''}: {cells}")
    print(f"RESULT near_duplicates images_per_s={chosen:.0f}")


if __name__ == "__main__":
    main()
