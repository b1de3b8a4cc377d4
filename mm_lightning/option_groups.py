"""Option groups: frozen dataclasses a LightningCLI config gives as nested keys (``--model.optim.lr 3e-3``,
``--data.loader.caption_sampling all``; a key left out keeps its default), and Python code as the dataclass or a
dict of its fields."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, TypeVar

Group = TypeVar("Group")


def as_config(cls: type[Group], value: Group | dict[str, Any] | None, where: str = "") -> Group:
    """The option group as its dataclass, from the dataclass, a dict of its fields or None (defaults); ``where``
    names the group in an error (``data.loader``)."""
    if value is None:
        return cls()
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(value) - known)
        if unknown:
            named = f"{where} ({cls.__name__})" if where else cls.__name__
            raise ValueError(f"{named}: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"expected {cls.__name__} or a dict, got {type(value).__name__}")
    return value


def as_record(group: Any) -> dict[str, Any]:
    """An option group as a plain dict (what a checkpoint's hyperparameters hold: it loads with
    ``weights_only=True``)."""
    return asdict(group)
