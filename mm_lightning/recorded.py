"""Objects a config names by ``class_path`` that a module built in Python records the same way."""

from __future__ import annotations

import inspect
from typing import Any


class Recorded:
    """Remembers the arguments it was built with, so that a rule built in Python is recorded in a checkpoint as a
    config names it (``class_path`` + ``init_args``) and reloads through the same checks."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        rule = super().__new__(cls)
        try:
            bound = inspect.signature(cls).bind(*args, **kwargs)
        except (
            TypeError
        ):  # a copy or an unpickling (no arguments; the state comes after), or a wrong call (which
            return rule  # __init__ then refuses)
        bound.apply_defaults()
        rule.recorded_args = dict(bound.arguments)
        return rule

    def record(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}`` of this rule."""
        cls = type(self)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(self.recorded_args)}
