"""The tokenizer that matches a text tower name (the data side loads it; the CLI links ``data.tokenizer`` to it).

Kept apart from the tower families so that both the CLI and the towers import it without a cycle.
"""

from __future__ import annotations

from mm_lightning.models.towers.open_clip import hf_tokenizer_dir
from mm_lightning.models.towers.registry import split_name


def tokenizer_for(text_tower: str) -> str:
    """The tokenizer (``AutoTokenizer`` name or directory) that matches a text tower name.

    ``clip:<dir>`` uses the directory's own tokenizer, ``open_clip:<model>`` an equivalent Hugging Face copy of
    open_clip's, and a bare Hugging Face name itself. Used by the CLI to link ``data.tokenizer`` to the model.

    Args:
        text_tower: the model's text tower name.
    """
    prefix, bare = split_name(text_tower)
    if prefix == "clip":
        return bare
    if prefix == "open_clip":
        return hf_tokenizer_dir(bare)
    return text_tower
