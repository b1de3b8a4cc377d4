"""Lightning's model summary, without a FLOPs column of zeros.

Lightning counts FLOPs in the summary only for a module with an ``example_input_array`` and otherwise prints
``0`` for every layer and "Total FLOPs: 0", which reads as a measurement. This summary leaves FLOPs out when they
were not measured (training FLOPs come from ``ThroughputMonitor`` and the module's ``flops_per_batch``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override


class ModelSummary(LightningModelSummary):
    """``ModelSummary`` (same arguments) that omits the FLOPs column and total when none were counted.

    The "Mode" column and the "Modules in eval mode" count show which submodules are in eval mode (e.g. frozen
    towers, kept in eval mode on purpose).
    """

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            LightningModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        columns = [
            (name, values) for name, values in summary_data if name != "FLOPs"
        ]  # the first is the index
        rows = len(columns[0][1]) if columns else 0
        header = [name for name, _ in columns]
        body = [[values[i] for _, values in columns] for i in range(rows)]
        widths = [max(len(cell) for cell in column) for column in zip(header, *body, strict=True)]

        def line(cells: list[str]) -> str:
            return " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))

        rule = "-" * len(line(header))
        totals = [
            f"{get_human_readable_count(trainable_parameters):<10} Trainable params",
            f"{get_human_readable_count(total_parameters - trainable_parameters):<10} Non-trainable params",
            f"{get_human_readable_count(total_parameters):<10} Total params",
            f"{get_formatted_model_size(model_size):<10} Total estimated model params size (MB)",
            f"{total_training_modes['train']:<10} Modules in train mode",
            f"{total_training_modes['eval']:<10} Modules in eval mode",
        ]
        rank_zero_info("\n".join(["", line(header), rule, *map(line, body), rule, *totals]))
