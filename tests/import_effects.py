"""What importing modules does to the process: PIL's pixel limit, the warnings filters, the ``atexit`` handlers.

Run as ``python tests/import_effects.py MODULE...``: imports every module of the ``mm_lightning`` package first to
learn which other modules (torch, Lightning, PIL...) it pulls in, so that a fresh process can import those before
taking its snapshot; then imports the named modules (default: every module of the package) and prints one JSON line
with the changes. Libraries' own import-time effects are thus left out; only the named modules' remain.
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
    """Every module of the package, imported in a stable order."""
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
        "import sys, json; from tests.import_effects import package_modules; import importlib;"
        "[importlib.import_module(m) for m in package_modules()];"
        "print(json.dumps([m for m in sys.modules if not m.startswith(('mm_lightning', 'tests'))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(modules: list[str]) -> None:
    for name in dependencies():
        try:
            importlib.import_module(name)
        except Exception:  # a private or platform-specific submodule that cannot be imported on its own
            pass
    before = snapshot()
    for name in modules or package_modules():
        importlib.import_module(name)
    after = snapshot()
    changes = {key: [before[key], after[key]] for key in before if before[key] != after[key]}
    print(json.dumps(changes))


if __name__ == "__main__":
    main(sys.argv[1:])
