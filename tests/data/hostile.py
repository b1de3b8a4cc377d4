"""Hostile records, as a scraped web dataset contains them: each case writes its files and returns a JSONL line.

Every case names the outcome training must give it: the :class:`~mm_lightning.data.RecordError` kind (a clear
error under ``raise``, a counted skip under ``skip``), or ``None`` for a record that looks odd but is valid.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from tests.data.helpers import natural_array, save_image


@dataclass(frozen=True)
class Case:
    """One hostile record.

    Attributes:
        name: test id.
        make: writes the files the record needs under ``root`` and returns its JSONL line (bytes, no newline).
        kind: the expected ``RecordError.kind``, or ``None`` when the record is valid.
    """

    name: str
    make: Callable[[Path], bytes]
    kind: str | None


def row(image: object, text: object, **extra: object) -> bytes:
    return json.dumps({"image": image, "text": text, **extra}).encode()


def _image(name: str, suffix: str = ".jpg", fmt: str | None = None, size: tuple[int, int] = (24, 20)):
    """A case whose record points at a real image saved as ``fmt`` under a ``suffix`` name."""

    def make(root: Path) -> bytes:
        path = root / "images" / f"{name}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(natural_array(size[1], size[0])).save(path, format=fmt)
        return row(f"images/{name}{suffix}", f"a photo called {name}")

    return make


def _file(name: str, content: bytes, suffix: str = ".jpg"):
    """A case whose image file holds ``content`` verbatim."""

    def make(root: Path) -> bytes:
        path = root / "images" / f"{name}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return row(f"images/{name}{suffix}", f"a file called {name}")

    return make


def _line(content: bytes) -> Callable[[Path], bytes]:
    return lambda root: content


def _good_image_with(text: object, name: str, **extra: object) -> Callable[[Path], bytes]:
    """A valid image file with an odd caption (or extra fields)."""

    def make(root: Path) -> bytes:
        save_image(root / "images" / f"text_{name}.jpg", (24, 20))
        return row(f"images/text_{name}.jpg", text, **extra)

    return make


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (a decompression bomb never needs its pixels)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = b"IDAT" + zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
        + struct.pack(">I", len(idat) - 4) + idat + struct.pack(">I", zlib.crc32(idat))
        + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    )  # fmt: skip


def _truncated_png(root: Path) -> bytes:
    path = save_image(root / "images" / "truncated.png", (64, 48))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return row("images/truncated.png", "half a picture")


def _directory(root: Path) -> bytes:
    (root / "images" / "folder.jpg").mkdir(parents=True)
    return row("images/folder.jpg", "a folder named like a photo")


def _fifo(root: Path) -> bytes:
    (root / "images").mkdir(parents=True, exist_ok=True)
    os.mkfifo(root / "images" / "pipe.jpg")  # opening it for reading would block forever
    return row("images/pipe.jpg", "a named pipe")


def _dangling_link(root: Path) -> bytes:
    (root / "images").mkdir(parents=True, exist_ok=True)
    os.symlink(root / "images" / "nowhere.jpg", root / "images" / "dangling.jpg")
    return row("images/dangling.jpg", "a link to nothing")


def _escaping_link(root: Path) -> bytes:
    outside = save_image(root.parent / f"{root.name}-outside" / "secret.jpg")
    (root / "images").mkdir(parents=True, exist_ok=True)
    os.symlink(outside, root / "images" / "escape.jpg")
    return row("images/escape.jpg", "a link leaving the image root")


def _absolute_outside(root: Path) -> bytes:
    outside = save_image(root.parent / f"{root.name}-outside2" / "abs.jpg")
    return row(str(outside), "an absolute path elsewhere")


def _odd_file_name(root: Path) -> bytes:
    name = "ca\nt \u202e🐱 \x1b[31m.jpg"  # newline, right-to-left override, emoji, escape sequence
    save_image(root / "images" / name)
    return row(f"images/{name}", "a cat with a strange file name")


def _forty_thousand_captions(root: Path) -> bytes:
    save_image(root / "images" / "many.jpg", (24, 20))
    return row("images/many.jpg", [f"caption {i}" for i in range(40_000)])


HTML = b"<!DOCTYPE html><html><head><title>404 Not Found</title></head><body>Not Found</body></html>\n"
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
DEEP = b'{"image": "images/x.jpg", "text": "deep", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BIG_INT = b'{"image": "images/x.jpg", "text": "big number", "id": ' + b"9" * 5000 + b"}"

CASES: list[Case] = [
    # images a web crawler saves
    Case("valid_jpeg", _image("valid"), None),
    Case("png_named_jpg", _image("png_as_jpg", ".jpg", "PNG"), None),
    Case("jpeg_named_png", _image("jpg_as_png", ".png", "JPEG"), None),
    Case("webp_named_jpg", _image("webp_as_jpg", ".jpg", "WEBP"), None),
    Case("tracking_pixel_gif", _image("pixel", ".jpg", "GIF", (1, 1)), None),
    Case("odd_file_name", _odd_file_name, None),
    Case("html_error_page", _file("html", HTML), "undecodable_image"),
    Case("zero_byte", _file("empty", b""), "undecodable_image"),
    Case("svg_named_jpg", _file("svg", SVG), "undecodable_image"),
    Case("random_bytes", _file("noise", os.urandom(2048)), "undecodable_image"),
    Case("truncated_png", _truncated_png, "undecodable_image"),
    Case("huge_dimensions", _file("bomb", png_header(30_000, 30_000), ".png"), "undecodable_image"),
    Case("extreme_aspect_ratio", _image("strip", ".png", "PNG", (400, 2)), "undecodable_image"),
    # paths
    Case("missing_file", _line(row("images/gone.jpg", "a deleted photo")), "missing_image"),
    Case("dangling_symlink", _dangling_link, "missing_image"),
    Case("directory", _directory, "bad_path"),
    Case("fifo", _fifo, "bad_path"),
    Case("nul_in_path", _line(row("images/a\0b.jpg", "a NUL byte")), "bad_path"),
    Case("lone_surrogate_path", _line(row("images/\ud800.jpg", "a lone surrogate")), "bad_path"),
    Case("name_too_long", _line(row("images/" + "x" * 300 + ".jpg", "a long name")), "bad_path"),
    Case("dotdot_escape", _line(row("../../etc/passwd", "climbing out")), "path_escapes_root"),
    Case("absolute_outside_root", _absolute_outside, "path_escapes_root"),
    Case("symlink_escaping_root", _escaping_link, "path_escapes_root"),
    # lines
    Case(
        "not_utf8", _line('{"image": "images/x.jpg", "text": "caf\xe9"}'.encode("latin-1")), "malformed_json"
    ),
    Case("deep_nesting", _line(DEEP), "malformed_json"),
    Case("five_thousand_digit_int", _line(BIG_INT), "malformed_json"),
    Case("truncated_json", _line(b'{"image": "images/x.jpg", "text": "cut'), "malformed_json"),
    Case("json_array", _line(b'["images/x.jpg", "a list"]'), "malformed_json"),
    Case("json_null", _line(b"null"), "malformed_json"),
    Case("binary_garbage", _line(bytes(range(1, 10)) + b"\xff\xfe"), "malformed_json"),
    Case("bom_prefixed_line", lambda r: b"\xef\xbb\xbf" + _good_image_with("bom", "bom")(r), None),
    Case("crlf_line_end", lambda r: _good_image_with("windows", "crlf")(r) + b"\r", None),
    Case("nan_in_unused_field", _good_image_with("a cat", "nan", score=float("nan")), None),
    Case("duplicate_keys", lambda r: _good_image_with("first", "dup")(r)[:-1] + b', "text": "second"}', None),
    Case("missing_image_key", _line(b'{"img": "images/x.jpg", "text": "wrong key"}'), "missing_key"),
    Case("missing_text_key", _line(b'{"image": "images/x.jpg", "caption": "wrong key"}'), "missing_key"),
    Case("image_is_number", _line(row(12345, "a number")), "bad_field"),
    Case("image_is_list", _line(row(["images/x.jpg"], "a list")), "bad_field"),
    Case("image_is_null", _line(row(None, "nothing")), "bad_field"),
    # captions
    Case("caption_is_number", _good_image_with(42, "num"), "bad_caption"),
    Case("caption_nested_list", _good_image_with([["a", "b"]], "nested"), "bad_caption"),
    Case("caption_is_object", _good_image_with({"en": "a cat"}, "obj"), "bad_caption"),
    Case("caption_lone_surrogate", _good_image_with("a cat \ud800", "surrogate"), "bad_caption"),
    Case("caption_list_empty", _good_image_with([], "nolist"), "empty_caption"),
    Case("caption_whitespace", _good_image_with(" \t\n ", "blank"), "empty_caption"),
    Case("caption_zero_width_only", _good_image_with("\u200b\u200d\ufeff", "zw"), "empty_caption"),
    Case("caption_control_only", _good_image_with("\x00\x01\x1b\x7f", "ctrl"), "empty_caption"),
    Case(
        "caption_html_emoji_rtl",
        _good_image_with("<b>caf&eacute;</b> 🐱 \u05e9\u05dc\u05d5\u05dd", "html"),
        None,
    ),
    Case("caption_with_control_chars", _good_image_with("a red\x00 cat \x1b[31m", "mixed"), None),
    Case("caption_fifty_thousand_words", _good_image_with("word " * 50_000, "long"), None),
    Case("forty_thousand_captions", _forty_thousand_captions, None),
]


def write_case_file(root: Path, lines: list[bytes], name: str = "split.jsonl") -> Path:
    """Write JSONL ``lines`` (bytes) under ``root``; returns the path."""
    path = root / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def good_line(root: Path, i: int) -> bytes:
    save_image(root / "images" / f"good{i}.jpg", (24, 20), seed=i)
    return row(f"images/good{i}.jpg", f"a good photo number {i}")
