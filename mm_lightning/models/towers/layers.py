"""Layer groups of the built-in towers, read from parameter names: what ``train_last`` and layer-wise decay act on."""

from __future__ import annotations

import re

from torch import nn


def numbered_layer_groups(tower: nn.Module, blocks: str, final: str | None = None) -> list[list[str]]:
    """The tower's parameter names in groups, input to output: what comes before the blocks (embeddings, stem),
    one group per block that ``blocks`` matches (numbered by its first group that matched), then the rest: the
    names after the first block that no block claims and the ones ``final`` matches wherever they were registered
    (the last norm, the pooling head, a projection)."""
    groups: dict[int, list[str]] = {}
    after_blocks = False
    for name, _ in tower.named_parameters():
        block = re.search(blocks, name)
        if block:
            key, after_blocks = 1 + int(next(number for number in block.groups() if number is not None)), True
        elif after_blocks or (final is not None and re.search(final, name)):
            key = 1 << 30
        else:
            key = 0
        groups.setdefault(key, []).append(name)
    return [groups[key] for key in sorted(groups)]
