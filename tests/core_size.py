"""Runs a one-step demo ``fit`` as shipped (its callbacks, its worker, a validation batch; smaller renders) and
prints, as JSON, the package modules it loaded with their lines; then a second step that names gradient caching (an
extra), and what that loaded on top.

    python tests/core_size.py <run folder>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mm_lightning.cli import main
from tests.conftest import small_demo_args


def package_modules() -> dict[str, int]:
    """Loaded ``mm_lightning`` modules -> lines of their source file."""
    loaded = {}
    for name, module in list(sys.modules.items()):
        source = getattr(module, "__file__", None)
        if (name == "mm_lightning" or name.startswith("mm_lightning.")) and source and source.endswith(".py"):
            loaded[name] = len(Path(source).read_text().splitlines())
    return loaded


def one_step(root: Path, *extra: str) -> None:
    args = [
        *small_demo_args(root),
        "--trainer.max_steps", "1",
        "--trainer.limit_val_batches", "1",
        "--trainer.val_check_interval", "1",
        "--trainer.default_root_dir", str(root),
        *extra,
    ]  # fmt: skip
    if main(["fit", *args]) != 0:
        raise SystemExit(f"the one-step fit failed: {args}")


if __name__ == "__main__":
    run = Path(sys.argv[1])
    one_step(run / "core")
    core = package_modules()
    opt_in = ["--model.batch_embedding", "mm_lightning.extras.GradientCaching"]
    one_step(run / "opt_in", "--data.init_args.data_dir", str(run / "core" / "demo"), *opt_in)
    print(json.dumps({"core": core, "opt_in": sorted(set(package_modules()) - set(core))}))
