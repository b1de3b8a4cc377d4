"""The tokenizer that matches a text tower, read from its ``class_path`` + ``init_args`` (the CLI links
``data.tokenizer`` to it before anything is built).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from jsonargparse import Namespace

from mm_lightning.models.towers.contract import TowerContractError


def tokenizer_of(text_tower: Any) -> str | None:
    """The tokenizer (``AutoTokenizer`` name or directory) of a text tower given by ``class_path`` + ``init_args``.

    A built-in tower says it (``tokenizer_for``: the model's own, or for open_clip an equivalent Hugging Face copy);
    a user's tower by its ``tokenizer`` argument.

    Args:
        text_tower: ``{"class_path": ..., "init_args": {...}}`` (a dict or the CLI's namespace).
    """
    if text_tower is None:
        return None
    spec = text_tower.as_dict() if isinstance(text_tower, Namespace) else dict(text_tower)
    class_path, init_args = spec.get("class_path"), dict(spec.get("init_args") or {})
    if not isinstance(class_path, str):
        return None  # not a class (yet): nothing to link
    module, _, name = class_path.rpartition(".")
    tower_class = getattr(import_module(module), name)
    if hasattr(tower_class, "tokenizer_for"):
        return tower_class.tokenizer_for(init_args)
    if init_args.get("tokenizer") is not None:
        return str(init_args["tokenizer"])
    raise TowerContractError(
        f"text tower {class_path} names no tokenizer: give it a `tokenizer` argument (the tokenizer its input ids"
        " come from, e.g. tokenizer: mm-lightning/demo-bert)"
    )
