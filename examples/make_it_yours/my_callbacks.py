"""A user's own callbacks (see README "Make it yours"): one added, one replacing a default."""

from __future__ import annotations

import json
import os

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import LearningRateMonitor


class CallbackList(Callback):
    """Writes the names of the trainer's callbacks at fit start."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer, pl_module) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump([type(c).__name__ for c in trainer.callbacks], f)


class MyLearningRateMonitor(LearningRateMonitor):
    """A user's replacement for a default callback."""
