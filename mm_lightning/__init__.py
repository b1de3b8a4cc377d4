"""mm_lightning: a PyTorch Lightning template for image-text (multimodal) training.

Run ``python -m mm_lightning fit --config configs/demo.yaml`` for the offline demo. The project's own errors derive
from :class:`ExplainedError` (how the command line prints them: :mod:`mm_lightning.errors`).
"""

from __future__ import annotations


class ExplainedError(Exception):
    """Base of errors whose message says what is wrong and where: the CLI prints it without a traceback."""


__version__ = "0.1.0"
