"""The packages' layering, read from the source: ``clients`` <- ``scheduler`` -> ``workers`` and no arrow
back, and no import cycle between modules, counting the imports made inside functions (a lazy import
still ties two modules together) and, for cycles, also those only a type checker sees (a type-only
cycle still ties two modules' designs together)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("clients", "scheduler", "workers")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports(source: str, mods: dict[str, Path] | None = None, *, typed: bool = False) -> set[str]:
    """The names every import statement in ``source`` reaches: a project module where one is meant
    (``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``), else the top-level name;
    those under ``if TYPE_CHECKING:`` only when ``typed``."""
    mods = _modules() if mods is None else mods
    tree = ast.parse(source)
    skip = set() if typed else _type_checking_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in mods else node.module)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return out


def graph(*, typed: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    return {m: {d for d in imports(p.read_text(), mods, typed=typed) if d in mods and d != m} for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_no_import_cycle_through_type_only_imports() -> None:
    assert cycles(graph(typed=True)) == []


def test_a_cycle_is_found() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


def test_workers_know_nothing_of_the_daemon_or_the_wire() -> None:
    reach = {m: ds for m, ds in graph().items() if m.startswith("workers")}
    wrong = {m: sorted(d for d in ds if d.split(".")[0] in ("clients", "scheduler")) for m, ds in reach.items()}
    assert {m: ds for m, ds in wrong.items() if ds} == {}


def test_clients_import_no_mlx_and_nothing_above_them() -> None:
    mods = _modules()
    wrong = {}
    for m, path in mods.items():
        if m.startswith("clients"):
            bad = sorted(
                d for d in imports(path.read_text(), mods) if d.split(".")[0] in ("mlx", "mlx_lm", *PACKAGES[1:])
            )
            if bad:
                wrong[m] = bad
    assert wrong == {}


def test_lazy_imports_count_and_type_checking_ones_do_not() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from scheduler.frontend import FrontEnd\n"
        "def f():\n    from workers import engine\n"
    )
    assert imports(source) == {"typing", "workers.engine"}
    assert imports(source, typed=True) == {"typing", "workers.engine", "scheduler.frontend"}


#: The daemon's modules that only the engine process (or the bench) imports: everything else in
#: ``scheduler`` is the front end's or the CLI's, and may load only the engine's light API.
ENGINE_SIDE = ("scheduler.engine_child", "scheduler.engine_outbox", "scheduler.bench", "scheduler.__main__")
#: What the front end may load from ``workers``.
LIGHT = ("workers", "workers.api", "workers.envs")

_IMPORT_FRONT_END = """
import importlib, pkgutil, sys
import scheduler, workers.api
skip = {skip!r}
for m in pkgutil.walk_packages(scheduler.__path__, "scheduler."):
    if not m.name.startswith(skip):
        importlib.import_module(m.name)
print(sorted(m for m in sys.modules if m == "mlx" or m.startswith(("mlx.", "mlx_lm"))))
print(sorted(m for m in sys.modules if m.startswith("workers")))
"""


def test_the_front_end_loads_no_mlx() -> None:
    """Importing the daemon's front end, its HTTP doors and the CLI (every ``scheduler`` module but
    the engine process's side) loads no ``mlx`` module and nothing of ``workers`` but its light API:
    the engine's vocabulary crosses the process boundary without the engine."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_FRONT_END.format(skip=ENGINE_SIDE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    mlx, workers = ast.literal_eval(out[-2]), ast.literal_eval(out[-1])
    assert mlx == []
    assert [m for m in workers if not (m in LIGHT or m.startswith("workers.api."))] == []


def _room(module: str) -> str | None:
    """The sub-package of ``workers`` a module lives in (``workers.kernels.levels`` -> ``kernels``)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "workers" and len(parts) > 2 else None


def deep_sibling_imports(mods: dict[str, Path] | None = None) -> dict[str, list[str]]:
    """Per ``workers`` module, its imports of another room's module that bypass that room's package
    (``from workers.kernels.levels import X`` from ``workers.exact``): a room's modules reach another
    room only through its ``__init__``'s surface. The light API (``workers.api``) and ``workers.envs``
    are for everyone."""
    mods = _modules() if mods is None else mods
    wrong: dict[str, list[str]] = {}
    for m, path in mods.items():
        here = _room(m) if path.name != "__init__.py" else m.split(".")[1] if m.count(".") else None
        if here is None:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                room = _room(t)
                if room is not None and room not in (here, "api"):
                    wrong.setdefault(m, []).append(t)
    return wrong


def test_rooms_reach_each_other_only_through_their_package() -> None:
    assert deep_sibling_imports() == {}


def test_a_deep_import_of_a_sibling_room_is_found(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from workers.kernels.levels import ladder\nfrom workers.kernels import scoped\n")
    found = deep_sibling_imports({"workers.exact.bad": bad})
    assert found == {"workers.exact.bad": ["workers.kernels.levels"]}
