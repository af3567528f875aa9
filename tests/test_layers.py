"""The package layout keeps its layers: no import circles between fastpar's modules, and no import from a lower
layer to a higher one (docs/design.md). Every import counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastpar"

# Higher numbers may import lower (and equal numbers inside the same part); never the other way round.
LAYERS = {
    "fastpar": 100,  # the public facade (lazy re-exports) and the command line
    "fastpar.__main__": 100,
    "fastpar.cli": 100,
    "fastpar.jobs": 90,
    "fastpar.train": 80,
    "fastpar.bench": 70,
    "fastpar.info": 65,  # `fastpar info`, also printed by the benchmarks
    "fastpar.zero": 60,  # ZeRO plugs into the DDP reducer
    "fastpar.shard": 58,  # FSDP2, pipeline stages and sharded checkpoints (torch's engines, fastpar's policies)
    "fastpar.ddp": 55,
    "fastpar.data": 50,
    "fastpar.costmodel": 50,
    "fastpar.topology": 45,
    "fastpar.comm": 31,  # the shared-memory backend loads its C++ half through fastpar.ops
    "fastpar.ops": 30,
    "fastpar.launcher": 10,  # spawning ranks and joining process groups
    "fastpar.rendezvous": 9,  # where the stores listen, how an agent reaches the rendezvous
    "fastpar.nodes": 8,  # nodes on one machine (namespaces, shaped links) for multi-node tests and benchmarks
    "fastpar.host": 5,
    "fastpar.tensor_storage": 5,  # the one storage counter of every memory report
    "fastpar.user_errors": 5,
    "fastpar.safe_files": 6,  # writing in folders others may write: no symlink followed, no foreign folder
    "fastpar._optional": 5,
    "fastpar._pickling": 5,
    "fastpar._version": 5,
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{alias.name}" for alias in node.names} & modules.keys()
            found |= submodules
            if len(submodules) < len(node.names) and source in modules:
                found.add(source)
    found.discard(name)
    return found


def _layer(name: str) -> tuple[int, str]:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return LAYERS[prefix], prefix
    raise AssertionError(f"{name} is in no layer: add its package to LAYERS (and to docs/design.md)")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer_and_imports_only_downwards():
    upward = []
    for name, targets in _graph().items():
        level, part = _layer(name)
        for target in targets:
            target_level, target_part = _layer(target)
            if target_level > level or (target_level == level and target_part != part and level != 100):
                upward.append(f"{name} ({part}) imports {target} ({target_part})")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def test_no_import_circles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"
