"""Files shipped inside the package, and the names that point at them.

``resolve_pretrained`` is the single place where a built-in model name becomes a local directory; every
``from_pretrained`` call in the project passes its name through it, so built-in names work offline anywhere
(a relative path in a config would only work from the repository root).

This package is a leaf: it imports nothing from the rest of ``mm_lightning``. The demo text encoder's files are
written by :func:`mm_lightning.data.demo.build_demo_bert`.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEMO_BERT = "mm-lightning/demo-bert"
BUILTIN: dict[str, Path] = {DEMO_BERT: ASSETS_DIR / "demo-bert"}


def resolve_pretrained(name_or_path: str) -> str:
    """Map a built-in name (e.g. ``"mm-lightning/demo-bert"``) to its local directory; return others unchanged."""
    builtin = BUILTIN.get(name_or_path)
    return str(builtin) if builtin is not None else name_or_path
