"""Short names for the built-in tower families and losses (``timm:``, ``open_clip:``, ``clip``, ``siglip``).

One registry type serves both: a family or a loss registers itself with a decorator in its own module, and that
module is imported on first use of its name, so a missing optional dependency only matters to its users. A
user's own tower or loss needs no registry: it is named by ``class_path`` in YAML.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class Registry(dict[str, Entry], Generic[Entry]):
    """Name -> entry (a builder or a class), filled by :meth:`register`, read by :meth:`lookup`.

    Args:
        what: what a name names, for messages (``"image tower family"``, ``"loss"``).
        package: the package whose module ``<package>.<name>`` registers a name not yet registered.
        modules: names registered by a module named otherwise (``{"hf": "hf_vision"}``).
    """

    def __init__(self, what: str, package: str, modules: dict[str, str] | None = None) -> None:
        super().__init__()
        self.what, self.package, self.modules = what, package, dict(modules or {})

    def register(self, name: str) -> Callable[[Entry], Entry]:
        """Decorator: makes ``name`` look up the decorated builder or class."""

        def decorate(entry: Entry) -> Entry:
            if name in self and self[name] is not entry:
                raise ValueError(f"{self.what} {name!r} is already registered by {self[name]}")
            self[name] = entry
            return entry

        return decorate

    def lookup(self, name: str) -> Entry:
        """The entry of ``name``, importing the module that registers it first if needed.

        Raises:
            ValueError: no module registers ``name``; the message lists the registered names.
        """
        for module_name in dict.fromkeys([self.modules.get(name), name]):
            if name in self or module_name is None:
                continue
            module = f"{self.package}.{module_name}"
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as error:
                if error.name != module:  # the module exists but one of its dependencies is missing
                    raise
        if name not in self:
            raise ValueError(
                f"unknown {self.what} {name!r}; registered: {', '.join(sorted(self)) or '(none)'}"
            )
        return self[name]
