"""Objects a config names by ``class_path`` that a module built in Python records the same way."""

from __future__ import annotations

import inspect
from typing import Any


class Recorded:
    """Remembers the arguments it was built with, so that a rule built in Python is recorded in a checkpoint as a
    config names it (``class_path`` + ``init_args``) and reloads through the same checks."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        rule = super().__new__(cls)
        signature = inspect.signature(cls.__init__)  # the class's own arguments, inherited ones included
        try:
            bound = signature.bind(rule, *args, **kwargs)
        except (
            TypeError
        ):  # a copy or an unpickling passes none (its state comes after); a wrong call, __init__ refuses
            return rule
        bound.apply_defaults()
        named = list(signature.parameters.values())[1:]
        keep = [p.name for p in named if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        rule.recorded_args = {name: bound.arguments[name] for name in keep}
        return rule

    def record(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}`` of this rule."""
        cls = type(self)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(self.recorded_args)}
