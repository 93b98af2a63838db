"""The import rules of docs/architecture.md: layers, no cycles, a static checker without the runtime.

Every `import` counts, at the top of a file or inside a function (a function-level
import runs when the function does, so it can close a cycle at run time). Those
under `if TYPE_CHECKING:` never run, so the layers leave them out, but they count
for cycles: a module that needs another's types to be read is not independent of
it. The generated parser is left out: its text is Lark's, not ours.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ROOT

PACKAGE = ROOT / "mklang"
GENERATED = {"mklang.syntax._parser"}

# Lowest first: a module may import its own layer and the layers before it, never a later one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "mklang.version",
            "mklang.errors",
            "mklang.exitcodes",
            "mklang.faults",
            "mklang.files",
            "mklang.limits",
            "mklang.yaml_composer",
            "mklang.terminal",
            "mklang.vocabulary",
            "mklang.model",
            "mklang.effects",
        ),
    ),
    (
        "language",
        (
            "mklang.syntax",
            "mklang.checker",
            "mklang.costs",
            "mklang.diagram",
            "mklang.drawn",
            "mklang.graph",
            "mklang.highlight",
        ),
    ),
    ("host", ("mklang.host", "mklang.mcp.servers", "mklang.mcp.client")),
    ("providers", ("mklang.providers",)),
    ("engine", ("mklang.engine",)),
    ("persistence", ("mklang.checkpoint", "mklang.stores")),
    (
        "running",
        (
            "mklang.scenarios",
            "mklang.session",
            "mklang.runs",
            "mklang.player",
            "mklang.comparison",
            "mklang.verification",
            "mklang.forking",
            "mklang.batching",
            "mklang.distributed",
            "mklang.telemetry",
        ),
    ),
    ("api", ("mklang",)),
    ("tools", ("mklang.cli", "mklang.console", "mklang.lsp", "mklang.mcp", "mklang.__main__")),
]

# What the static checker (`mklang check`, the editor's diagnostics) must never load.
RUNTIME = (
    "mklang.engine",
    "mklang.providers",
    "mklang.host",
    "mklang.checkpoint",
    "mklang.stores",
    "mklang.session",
    "mklang.runs",
    "mklang.scenarios",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    """The index of the layer a module belongs to (the longest matching prefix wins)."""
    best = max(
        (
            (len(prefix), index)
            for index, (_, prefixes) in enumerate(LAYERS)
            for prefix in prefixes
            if module == prefix or module.startswith(prefix + ".")
        ),
        default=None,
    )
    assert best is not None, (
        f"{module} is in no layer of tests/test_architecture.py (add it, and to docs/architecture.md)"
    )
    return best[1]


def _runs(node: ast.AST, top_only: bool, typing: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under `node` that can run (those under `if TYPE_CHECKING:` cannot,
    unless `typing`); with `top_only`, only those that run when the module is imported (not
    inside a function)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not typing:
            children: list[ast.AST] = list(child.orelse)
        elif top_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:
            children = [child]
        for each in children:
            if isinstance(each, (ast.Import, ast.ImportFrom)):
                yield each
            else:
                yield from _runs(each, top_only, typing)


def _known(name: str) -> str | None:
    """The mklang module that importing `name` executes last (a name inside a module is its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, top_only: bool = False, typing: bool = False) -> set[str]:
    """Every mklang module `module` imports, at any depth of its file (with `top_only`, on import;
    with `typing`, under `if TYPE_CHECKING:` too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runs(ast.parse(path.read_text(encoding="utf-8")), top_only, typing):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        found |= {target for name in names if (target := _known(name)) and target != module}
    return found


GRAPH = {module: imports(module) for module in MODULES if module not in GENERATED}
ON_IMPORT = {module: imports(module, top_only=True) for module in GRAPH}
TYPED = {module: imports(module, typing=True) for module in GRAPH}  # with what only a type checker reads


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each a cycle or several."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_a_module_imports_only_its_own_layer_and_lower_ones(module):
    mine = layer_of(module)
    upward = sorted(target for target in GRAPH[module] if layer_of(target) > mine)
    assert not upward, (
        f"{module} ({LAYERS[mine][0]}) imports "
        + ", ".join(f"{target} ({LAYERS[layer_of(target)][0]})" for target in upward)
        + ": see docs/architecture.md"
    )


def test_stores_import_only_the_foundation():
    """A store keeps bytes: it knows no envelope, journal or engine, so a backend is written alone."""
    foundation = LAYERS[0][1]
    beyond = {
        module: sorted(t for t in GRAPH[module] if not t.startswith(("mklang.stores", *foundation)))
        for module in GRAPH
        if module.startswith("mklang.stores")
    }
    assert {module: targets for module, targets in beyond.items() if targets} == {}


def test_persistence_knows_the_engines_frames_not_how_it_runs():
    """A checkpoint stores frames, their traces and step records, so persistence reads those engine
    modules; starting and driving the engine is the run service's, above it."""
    data = {"mklang.engine.frame", "mklang.engine.trace", "mklang.engine.records"}
    reached = {
        module: sorted(t for t in GRAPH[module] if t.startswith("mklang.engine") and t not in data)
        for module in GRAPH
        if layer_of(module) == layer_of("mklang.checkpoint")
    }
    assert {module: targets for module, targets in reached.items() if targets} == {}


@pytest.mark.parametrize("module", ["mklang.batching", "mklang.distributed"])
def test_batches_and_workers_reach_stored_runs_only_through_the_runs_package(module):
    """No envelope, journal or signature of their own: the service opens, verifies and reports runs,
    with each run's lock held. Of persistence they use the machine texts a store keeps."""
    assert sorted(t for t in GRAPH[module] if t.startswith("mklang.checkpoint")) in ([], ["mklang.checkpoint.texts"])
    assert "mklang.runs" in GRAPH[module]


STARTERS = {"run", "continue_run", "make_runtime"}  # what starts or continues a run in the engine


def test_only_the_runs_package_starts_or_continues_a_run():
    """One door: the CLI, the API, batches, workers and the scenario player reach the engine's
    `run`, `continue_run` and `make_runtime` through `mklang.runs`, never directly."""
    reached = {
        module: sorted(
            alias.name
            for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) and node.module == "mklang.engine"
            for alias in node.names
            if alias.name in STARTERS
        )
        for module in GRAPH
        if not module.startswith("mklang.engine")
    }
    assert {module: names for module, names in reached.items() if names} == {
        "mklang.runs.driving": ["continue_run", "make_runtime"],
        "mklang.runs.starting": ["run"],
    }


def test_no_import_cycles_not_even_through_what_only_a_type_checker_reads():
    assert cycles(TYPED) == []


def test_the_cycle_finder_reads_imports_under_type_checking():
    """`TYPED` holds what `GRAPH` leaves out: a request names the store `Location` type, which only a
    type checker imports."""
    assert "mklang.stores" in TYPED["mklang.runs.request"] - GRAPH["mklang.runs.request"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def loaded_by(module: str, apart: frozenset[str] = frozenset()) -> set[str]:
    """Every mklang module that using `module` can execute: what it imports anywhere, and the
    packages containing each (a package's `__init__` runs on import, its functions need not);
    the modules `apart` and what only they import are left out."""
    seen: dict[str, bool] = {}  # module -> whether its function-level imports were followed too
    todo = [(module, True)]
    while todo:
        current, whole = todo.pop()
        if current in apart or seen.get(current, False) or (current in seen and not whole):
            continue
        seen[current] = whole
        parent = current.rpartition(".")[0]
        todo.extend((target, True) for target in (GRAPH if whole else ON_IMPORT).get(current, ()))
        if parent:
            todo.append((parent, False))
    return set(seen)


@pytest.mark.parametrize("entry", ["mklang.cli.syntax_cmds", "mklang.checker", "mklang.lsp.analysis"])
def test_the_static_checker_loads_no_engine_provider_host_or_store(entry):
    # `check --cost` prices the bounds with the host config, in a module of its own that only it imports.
    apart = frozenset({"mklang.cli.cost_report"})
    assert sorted(m for m in loaded_by(entry, apart) if m.startswith(RUNTIME)) == []


def test_the_yaml_front_end_uses_no_private_name_of_the_builder():
    source = (PACKAGE / "syntax" / "yaml_front.py").read_text(encoding="utf-8")
    assert "builder._" not in source and "import Builder, _" not in source


def taken_from_runs(source: str) -> set[str]:
    """The names a module's text takes from the runs package: imported from it, or read off it
    (`runs.proceed`, after `from mklang import runs`)."""
    taken: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mklang.runs"):
            taken |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "runs":
            taken.add(node.attr)
    return taken


# Every surface that continues a stored run: the CLI, the API, the console, the MCP server, batch claims (which the
# workers' and `mklang batch`'s passes use), and the scenario player.
RESUMING = [
    "mklang.cli.run_cmds",
    "mklang._api",
    "mklang.console.answers",
    "mklang.mcp.tools",
    "mklang.runs.claims",
    "mklang.player",
]


def test_a_stored_run_is_resumed_in_one_place():
    """Opening a stored run, hosting it and driving it (`opened` -> `build_host` -> `proceed`) is
    written once, in `runs.resuming.resume`: every surface calls it, none drives an opened run itself."""
    drivers = sorted(
        module
        for module, path in MODULES.items()
        if module != "mklang.runs" and "proceed" in taken_from_runs(path.read_text(encoding="utf-8"))
    )
    assert drivers == ["mklang.runs.resuming"]
    for surface in RESUMING:
        assert "resume" in taken_from_runs(MODULES[surface].read_text(encoding="utf-8")), surface
    assert "claim" in taken_from_runs(MODULES["mklang.batching"].read_text(encoding="utf-8"))
    assert "mklang.batching" in GRAPH["mklang.distributed"]  # workers run their claims through a batch


def test_the_resume_scan_finds_a_surface_that_drives_a_run_itself():
    second = (
        "from mklang import runs\n\ndef again(x, host):\n    with runs.opened(x) as r:\n        runs.proceed(r, host)\n"
    )
    assert {"opened", "proceed"} <= taken_from_runs(second)
    assert "proceed" in taken_from_runs("from mklang.runs.driving import proceed as drive\n")


def test_the_console_reads_and_resumes_runs_only_through_the_runs_package():
    """No envelope of its own, no batch runner, no command's parser or host options: what the console
    shows and the replies it delivers go through `mklang.runs`, as `mklang show` and `resume` do."""
    reached = {
        module: sorted(
            target
            for target in TYPED[module]
            if target.startswith(("mklang.checkpoint", "mklang.batching", "mklang.cli.run_cmds", "mklang.cli.hosting"))
        )
        for module in GRAPH
        if module.startswith("mklang.console")
    }
    assert {module: targets for module, targets in reached.items() if targets} == {}
