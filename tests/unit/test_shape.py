"""CI holds the shape of the product code (autoshard/, service/): no module over 600 lines, no
function or method over 80, and no import that climbs the layer order of
docs/design/layers.md, nor any import circle.

Long modules and functions of today sit in `ALLOWED`, which may only shrink: an entry fails when
it grows, and when it is back within the limit or gone (delete it then). After a merge, print
the list of today's tree with

    python -m tests.unit.test_shape --allowlist

Every import counts: at module level, under `if TYPE_CHECKING:` and inside a function, since
each is a dependency a reader must know about to move or test the importing module.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("autoshard", "service")
MODULE_LINES = 600
FUNCTION_LINES = 80

ALLOWED: dict[str, int] = {}
"""Long modules (`path`) and functions (`path::qualname`) let through, with their lengths: none
since the redesign; an entry may only shrink or go."""

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", ("autoshard", "autoshard.errors", "autoshard.units", "autoshard.limits",
                "autoshard.files", "autoshard.progress", "autoshard.deadline")),
    ("value types", ("autoshard.mesh", "autoshard.sharding", "autoshard.collectives",
                     "autoshard.holding")),
    ("graph IR", ("autoshard.ir",)),
    ("parameters", ("autoshard.names", "autoshard.weights")),
    ("op rules", ("autoshard.rules",)),
    ("graph analysis", ("autoshard.analysis",)),
    ("plans and programs", ("autoshard.annotations", "autoshard.plan", "autoshard.program",
                            "autoshard.reshard")),
    ("deciding by rule", ("autoshard.propagate", "autoshard.training")),
    ("cost model", ("autoshard.cost",)),
    ("lowering", ("autoshard.passes", "autoshard.mlir")),
    ("search", ("autoshard.search",)),
    ("plan document", ("autoshard.document",)),
    ("pipeline", ("autoshard.pipeline",)),
    ("uses of a plan", ("autoshard.export", "autoshard.execute", "autoshard.explain",
                        "autoshard.html", "autoshard.run", "autoshard.sweep")),
    ("REST service", ("service",)),
    ("command line", ("autoshard.cli", "autoshard.__main__")),
)  # fmt: skip
"""The floors, bottom up, by module prefix (the longest prefix decides; `autoshard` alone is the
package's `__init__`). A module imports only from its own floor or below."""


# ---- reading the tree -----------------------------------------------------------------------


@cache
def modules() -> dict[str, Path]:
    """Every product module by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Import:
    """`source` imports `target` (both product modules) at `line`."""

    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{relative(modules()[self.source])}:{self.line} imports {self.target}"


def _known(name: str) -> str | None:
    """The product module `name` names: itself, or the module it is an attribute of."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def _imports_of(module: str) -> Iterator[Import]:
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _known(name)
            if target is not None and target != module:
                yield Import(module, target, node.lineno)


@cache
def imports() -> tuple[Import, ...]:
    return tuple(i for module in modules() for i in _imports_of(module))


def floor_of(module: str) -> int | None:
    """The floor of `module`'s longest listed prefix; None when no prefix lists it."""
    matches = [
        (len(prefix), floor)
        for floor, (_, prefixes) in enumerate(FLOORS)
        for prefix in prefixes
        # `autoshard` alone is the package's __init__, not all of the package.
        if module == prefix or (prefix != "autoshard" and module.startswith(prefix + "."))
    ]
    return max(matches)[1] if matches else None


def lengths() -> dict[str, int]:
    """The length of every module and every function or method (from `def` to its last line),
    keyed as in `ALLOWED`."""
    found = {}
    for path in modules().values():
        source = path.read_text()
        found[relative(path)] = len(source.splitlines())
        found.update(_function_lengths(ast.parse(source), f"{relative(path)}::"))
    return found


def _function_lengths(node: ast.AST, prefix: str) -> dict[str, int]:
    found = {}
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + child.name
            end = child.end_lineno or child.lineno
            found[name] = max(found.get(name, 0), end - child.lineno + 1)
            found.update(_function_lengths(child, f"{name}.<locals>."))
        elif isinstance(child, ast.ClassDef):
            found.update(_function_lengths(child, f"{prefix}{child.name}."))
        else:
            found.update(_function_lengths(child, prefix))
    return found


def limit(key: str) -> int:
    return FUNCTION_LINES if "::" in key else MODULE_LINES


def over_limit() -> dict[str, int]:
    return {k: n for k, n in sorted(lengths().items()) if n > limit(k)}


# ---- the tests --------------------------------------------------------------------------------


def test_no_module_or_function_over_the_limit_unless_allowed():
    found = [
        f"{k}: {n} lines ({f'allowed {ALLOWED[k]}' if k in ALLOWED else f'limit {limit(k)}'})"
        for k, n in over_limit().items()
        if n > ALLOWED.get(k, limit(k))
    ]
    assert not found, "split these (modules <= 600 lines, functions <= 80):\n" + "\n".join(found)


def test_allowlist_only_shrinks():
    now = lengths()
    stale = [
        f"{k}: {'gone' if k not in now else f'{now[k]} lines, within {limit(k)}'}"
        for k in ALLOWED
        if now.get(k, 0) <= limit(k)
    ]
    assert not stale, "delete these entries of ALLOWED:\n" + "\n".join(stale)


def test_every_module_has_a_floor():
    lost = sorted(m for m in modules() if floor_of(m) is None)
    assert not lost, f"add these modules to a floor of FLOORS (by prefix): {lost}"


def test_no_import_climbs_the_floors():
    climbs = []
    for i in imports():
        source, target = floor_of(i.source), floor_of(i.target)
        if source is not None and target is not None and target > source:
            climbs.append(f"{i} (floor {FLOORS[source][0]!r} below {FLOORS[target][0]!r})")
    assert not climbs, "imports up the floors of docs/design/layers.md:\n" + "\n".join(climbs)


def test_no_import_circles():
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for i in imports():
        graph[i.source].add(i.target)
    circle = _circle(graph)
    assert circle is None, "modules import each other in a circle: " + " -> ".join(circle or [])


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, closed (its first module repeated last), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph[module]):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done and (found := visit(target)) is not None:
                return found
        path.pop()
        on_path.discard(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (found := visit(module)) is not None:
            return found
    return None


@pytest.mark.parametrize(
    "graph, circle",
    [
        ({"a": {"b"}, "b": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
    ],
    ids=["line", "three-circle", "diamond"],
)
def test_circle_finder(graph, circle):
    assert _circle(graph) == circle


@pytest.mark.parametrize(
    "module, floor",
    [
        ("autoshard", "leaves"),
        ("autoshard.errors", "leaves"),
        ("autoshard.search.solver.cp_sat", "search"),
        ("autoshard.cost.liveness", "cost model"),
        ("autoshard.html.page", "uses of a plan"),
        ("service.app", "REST service"),
    ],
)
def test_floors_go_by_prefix(module, floor):
    index = floor_of(module)
    assert index is not None and FLOORS[index][0] == floor
    assert floor_of("autoshard.unheard_of") is None


if __name__ == "__main__":
    if sys.argv[1:] != ["--allowlist"]:
        sys.exit("usage: python -m tests.unit.test_shape --allowlist")
    print("ALLOWED: dict[str, int] = {")
    for key, length in over_limit().items():
        print(f"    {key!r}: {length},".replace("'", '"'))
    print("}")
