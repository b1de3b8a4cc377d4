"""Callbacks: monitors, prediction writer, NaN guard."""

from mm_lightning.callbacks.prediction import EmbeddingWriter  # noqa: E402,F401
