"""Layer groups of the built-in towers, read from parameter names: what ``train_last`` and ``layer_decay`` act on."""

from __future__ import annotations

import re

from torch import nn


def numbered_layer_groups(tower: nn.Module, blocks: str, final: str | None = None) -> list[list[str]]:
    """The tower's parameter names in groups, input to output: the rest (embeddings, stem) first, then one group per
    block that ``blocks`` matches (numbered by its first group that matched), then the names ``final`` matches
    (the last norm, the pooling head)."""
    groups: dict[int, list[str]] = {}
    for name, _ in tower.named_parameters():
        block = re.search(blocks, name)
        if block:
            key = 1 + int(next(number for number in block.groups() if number is not None))
        elif final is not None and re.search(final, name):
            key = 1 << 30
        else:
            key = 0
        groups.setdefault(key, []).append(name)
    return [groups[key] for key in sorted(groups)]
