"""Callbacks: monitors, prediction writer, NaN guard."""
