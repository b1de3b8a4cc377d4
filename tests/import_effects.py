"""What importing modules does to the process: PIL's pixel limit, the warnings filters, the ``atexit`` handlers.

Run as ``python tests/import_effects.py [MODULE...]``. It first learns, from a fresh process that imports every
module of the ``mm_lightning`` package, which other modules (torch, Lightning, PIL...) the package pulls in, and
imports those, so that their own import-time effects are left out. Then it imports every module of the package,
then the named modules (a control), and prints one JSON line: the changes each of the two steps made.
"""

from __future__ import annotations

import atexit
import importlib
import json
import pkgutil
import subprocess
import sys
import warnings


def package_modules() -> list[str]:
    """Every module of the package, in a stable order."""
    import mm_lightning

    names = ["mm_lightning"]
    names += [m.name for m in pkgutil.walk_packages(mm_lightning.__path__, "mm_lightning.")]
    return sorted(names)


def snapshot() -> dict[str, object]:
    from PIL import Image

    return {
        "PIL.Image.MAX_IMAGE_PIXELS": Image.MAX_IMAGE_PIXELS,
        "warnings.filters": [repr(f) for f in warnings.filters],
        "atexit handlers": atexit._ncallbacks(),
    }


def dependencies() -> list[str]:
    """Modules outside the package that importing all of it loads, in import order (from a fresh process)."""
    code = (
        "import sys, json, importlib; from tests.import_effects import package_modules;"
        "[importlib.import_module(m) for m in package_modules()];"
        "print(json.dumps([m for m in sys.modules if not m.startswith(('mm_lightning', 'tests'))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def changes_by_importing(modules: list[str]) -> dict[str, list[object]]:
    before = snapshot()
    for name in modules:
        importlib.import_module(name)
    after = snapshot()
    return {key: [before[key], after[key]] for key in before if before[key] != after[key]}


def main(controls: list[str]) -> None:
    for name in dependencies():
        try:
            importlib.import_module(name)
        except Exception:  # a private or platform-specific submodule that cannot be imported on its own
            pass
    package = changes_by_importing(package_modules())
    print(json.dumps({"package": package, "controls": changes_by_importing(controls)}))


if __name__ == "__main__":
    main(sys.argv[1:])
