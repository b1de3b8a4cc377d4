"""The package stays readable as a template: no import cycle, one-way layers, the explicit all-reduce off the
read path, the core naming no extra, Lightning's loop state written in one module, no private name imported across
modules, no deprecation shims, no private Lightning name.

Imports are read from the source (every ``import``, also those inside functions), so a lazy import that
would close a cycle counts too.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "mm_lightning"
# (importer prefix, prefixes it must not import): the read path of ``fit`` goes cli -> module -> model ->
# towers/losses -> data, never back; evaluation is the module's, the commands sit on top.
COMMAND_LINE = (
    "mm_lightning.cli",
    "mm_lightning.config_parser",
    "mm_lightning.checkpoints.run_folder",
    "mm_lightning.commands",
)
LAYERS = [
    ("mm_lightning.data", ("mm_lightning.models", "mm_lightning.evaluation", "mm_lightning.callbacks",
                           "mm_lightning.checkpoints", *COMMAND_LINE)),
    ("mm_lightning.models", ("mm_lightning.callbacks", *COMMAND_LINE)),
    ("mm_lightning.evaluation", ("mm_lightning.callbacks", "mm_lightning.checkpoints", *COMMAND_LINE)),
    ("mm_lightning.callbacks", COMMAND_LINE),
    ("mm_lightning.checkpoints", ("mm_lightning.cli", "mm_lightning.config_parser", "mm_lightning.commands")),
]  # fmt: skip


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    mods = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (a package's imports of its own submodules left out)."""
    mods = module_files(root)
    top = root.name

    def resolve(target: str) -> str | None:
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in mods:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(top):
                targets |= {resolve(f"{node.module}.{alias.name}") for alias in node.names}
            elif isinstance(node, ast.Import):
                targets |= {resolve(alias.name) for alias in node.names if alias.name.startswith(top)}
        is_package = path.name == "__init__.py"
        graph[name] = {
            t for t in targets if t and t != name and not (is_package and t.startswith(name + "."))
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_layers_import_one_way() -> None:
    graph = import_graph(PACKAGE)
    wrong = [
        f"{m} -> {t}"
        for prefix, forbidden in LAYERS
        for m, targets in graph.items()
        if m.startswith(prefix)
        for t in targets
        if t.startswith(forbidden)
    ]
    assert wrong == []


# the core: what a run uses whatever its config says; the opt-in parts in extras plug into its typed slots
CORE = ("models", "data", "checkpoints", "evaluation", "callbacks")


def extras_named_by_the_core(root: Path) -> list[str]:
    """Each place a core module names an extra: an import of it at any depth (inside functions too), or a string
    that names it (an ``import_module`` path, a preload list, a docstring's reference)."""
    extras = f"{root.name}.extras"
    core = tuple(f"{root.name}.{layer}" for layer in CORE)
    graph = import_graph(root)
    found = []
    for name, path in module_files(root).items():
        if not name.startswith(core):
            continue
        found += [f"{name} -> {t}" for t in sorted(graph[name]) if t == extras or t.startswith(extras + ".")]
        found += [
            f"{name}:{node.lineno} names {extras}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and extras in node.value
        ]
    return found


def test_the_core_never_names_an_extra() -> None:
    assert extras_named_by_the_core(PACKAGE) == []


def test_control_an_extra_the_core_names_is_found(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/extras/__init__.py": "", "pkg/extras/x.py": "y = z = 1\n",
        "pkg/models/__init__.py": "",
        "pkg/models/m.py": "def f():\n    from pkg.extras import x\n",
        "pkg/data/__init__.py": "",
        "pkg/data/d.py": "import importlib\n\nPRELOAD = ['pkg.extras.x']\n",
        "pkg/commands/__init__.py": "", "pkg/commands/c.py": "from pkg.extras.x import y\n",
    })  # fmt: skip
    assert sorted(extras_named_by_the_core(pkg)) == [
        "pkg.data.d:3 names pkg.extras",
        "pkg.models.m -> pkg.extras.x",
    ]


LOOP_STATE_WRITER = "mm_lightning.data.resume"
LOOP_STATE = re.compile(r"\b(fit_loop|epoch_loop|\w*progress)\b")


def loop_state_writers(root: Path) -> list[str]:
    """Writes to Lightning's loop state: assignments and ``setattr`` on a loop or a progress counter (a method
    that changes one, such as ``increment_ready``, is not looked for)."""
    found = []
    for name, path in sorted(module_files(root).items()):
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.AST] = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [t for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [node.args[0]]
            found += [f"{name}:{node.lineno}" for t in targets if LOOP_STATE.search(ast.unparse(t))]
    return found


def test_lightning_loop_state_is_written_in_one_module() -> None:
    assert {where.split(":")[0] for where in loop_state_writers(PACKAGE)} <= {LOOP_STATE_WRITER}


def test_control_a_loop_state_write_elsewhere_is_found(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f(trainer):\n    trainer.fit_loop.epoch_loop.batch_progress.current.ready = 0\n",
        "pkg/b.py": "def g(progress):\n    setattr(progress.current, 'ready', 1)\n    progress.is_last_batch = True\n",
        "pkg/c.py": "def h(x):\n    x.progress_bar = 1\n    loop = x.fit_loop\n",
    })  # fmt: skip
    assert sorted(loop_state_writers(pkg)) == ["pkg.a:2", "pkg.b:2", "pkg.b:3"]


def private_imports(root: Path) -> list[str]:
    """``module: name`` for every private name (``_x``) imported from another module of the package."""
    found = []
    for name, path in module_files(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(root.name):
                found += [
                    f"{name}: {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and a.name != "__version__"
                ]
    return found


def test_no_private_import_across_modules() -> None:
    assert private_imports(PACKAGE) == []


def test_control_a_private_import_is_found(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "def _f():\n    pass\n",
                            "pkg/b.py": "def g():\n    from pkg.a import _f\n"})  # fmt: skip
    assert private_imports(pkg) == ["pkg.b: _f"]


def test_no_deprecation_shims() -> None:
    for name, path in module_files(PACKAGE).items():
        tree = ast.parse(path.read_text())
        top_level = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert "__getattr__" not in top_level, f"{name}: module-level __getattr__ (a lazy alias)"
        assert "DeprecationWarning" not in path.read_text(), f"{name}: a deprecation shim"


ASSIGNED_OR_DEFINED = (re.compile(r"self\.(_[a-z]\w*)\s*[:=]"), re.compile(r"def (_[a-z]\w*)\("))


def private_names_defined(root: Path) -> set[str]:
    """``_name``s a package defines: attributes it assigns on ``self`` and functions or methods it defines."""
    return {
        name
        for path in root.rglob("*.py")
        for pattern in ASSIGNED_OR_DEFINED
        for name in pattern.findall(path.read_text(errors="ignore"))
    }


def private_lightning_uses(root: Path) -> list[str]:
    """``module:line name`` for every private Lightning name the package reads: an attribute or a ``getattr`` string
    that Lightning defines and the package does not, or an import from a private Lightning module or name."""
    import lightning

    lightning_names = private_names_defined(Path(lightning.__file__).parent)
    ours = private_names_defined(root)
    found = []
    for name, path in module_files(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            used = None
            if isinstance(node, ast.Attribute):
                used = node.attr
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                "getattr",
                "hasattr",
                "setattr",
            ):
                used = next((a.value for a in node.args[1:2] if isinstance(a, ast.Constant)), None)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
                parts = [*node.module.split("."), *(a.name for a in node.names)]
                used = next((part for part in parts if part.startswith("_")), None)
                if used is not None:
                    found.append(f"{name}:{node.lineno} {used}")
                continue
            if isinstance(used, str) and used in lightning_names and used not in ours:
                found.append(f"{name}:{node.lineno} {used}")
    return found


def test_no_private_lightning_name() -> None:
    assert private_lightning_uses(PACKAGE) == []


def test_control_a_private_lightning_name_is_found(tmp_path: Path) -> None:
    code = (
        "from lightning.pytorch.trainer.connectors.logger_connector import _LoggerConnector\n"
        "def f(trainer, cb):\n"
        "    cb._save_last_checkpoint(trainer, {})\n"
        "    return getattr(trainer, '_logger_connector').should_update_logs\n"
    )
    pkg = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": code})
    assert private_lightning_uses(pkg) == [
        "pkg.a:1 _LoggerConnector", "pkg.a:3 _save_last_checkpoint", "pkg.a:4 _logger_connector",
    ]  # fmt: skip


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_control_a_cycle_is_found(tmp_path: Path) -> None:
    # Control: the check above can fail (a lazy import closing a cycle).
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a\n",
            "pkg/a.py": "from pkg.b import f\n",
            "pkg/b.py": "def f():\n    from pkg.a import g\n",
        },
    )
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


def test_control_package_imports_of_children_are_not_cycles(tmp_path: Path) -> None:
    # A package re-exporting its children while a child imports a sibling is the normal layout, not a cycle.
    pkg = _write(tmp_path, {"pkg/__init__.py": "from pkg.a import x\n", "pkg/a.py": "from pkg.b import y\n",
                            "pkg/b.py": "y = 1\n"})  # fmt: skip
    assert cycles(import_graph(pkg)) == []


# Imports every module of a package as the first of that package in the process: the package's modules are dropped
# from sys.modules in between (the libraries stay loaded, so each costs milliseconds). Prints the failures as JSON.
IMPORT_EACH_FIRST = """
import importlib, json, sys, traceback
sys.path.insert(0, sys.argv[1])
failed = {}
for name in sys.argv[3:]:
    for loaded in [m for m in sys.modules if m == sys.argv[2] or m.startswith(sys.argv[2] + ".")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as err:
        failed[name] = f"{type(err).__name__}: {err}"
print(json.dumps(failed))
"""


def modules_failing_when_imported_first(root: Path) -> dict[str, str]:
    names = sorted(n for n in module_files(root) if not n.endswith("__main__"))  # __main__ runs the CLI
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_FIRST, str(root.parent), root.name, *names],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_module_imports_first() -> None:
    """Whichever module a user imports first loads (packages that import each other load in any order)."""
    assert modules_failing_when_imported_first(PACKAGE) == {}


def test_control_a_module_that_fails_when_imported_first_is_found(tmp_path: Path) -> None:
    # two packages whose __init__ import their modules, each module importing the other package's
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/p/__init__.py": "from pkg.p.m import M\n",
        "pkg/p/m.py": "from pkg.q.n import N\n\nclass M:\n    pass\n",
        "pkg/q/__init__.py": "from pkg.q.n import N\n",
        "pkg/q/n.py": "from pkg.p.m import M\n\nclass N:\n    pass\n",
    })  # fmt: skip
    failing = modules_failing_when_imported_first(pkg)
    assert set(failing) >= {"pkg.p", "pkg.q"} and "ImportError" in failing["pkg.p"]
