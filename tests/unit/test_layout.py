"""The tree's shape (docs/architecture.md): layers import downwards only, no import cycle, no private
attribute of another library written."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "titanrush"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The titanrush modules `path` imports (`from pkg import name` counts `pkg.name` where that is a
    module, else `pkg`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titanrush"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("titanrush")}
    return found & set(modules)


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    # A package's __init__ importing its own submodules is how packages re-export; not a cycle.
    graph = {
        n: {d for d in deps if not (n in modules and d.startswith(n + "."))} for n, deps in graph.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


# The layers, lowest first (docs/architecture.md): a module may import its own layer and those below it.
LAYERS: list[tuple[str, ...]] = [
    (
        "titanrush.cli",
        "titanrush.config",
        "titanrush.distributed",
        "titanrush.errors",
        "titanrush.files",
        "titanrush.launch_env",
        "titanrush.logging_utils",
        "titanrush.metrics",
        "titanrush.optim",
        "titanrush.profiling",
    ),
    ("titanrush.parallel",),
    ("titanrush.models", "titanrush.data"),
    ("titanrush.checkpoint",),
    ("titanrush.interop",),
    ("titanrush.run",),
    ("titanrush.trainer", "titanrush.train"),
    ("titanrush.tools", "titanrush.__main__"),
]


def _layer(name: str) -> int:
    if name == "titanrush":
        return 0
    for level, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{name} is in no layer: add it to LAYERS and to docs/architecture.md")


def test_imports_point_down_the_layers():
    modules = _modules()
    upward = [
        f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})"
        for name, path in sorted(modules.items())
        for dep in sorted(_imports(path, modules))
        if _layer(dep) > _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_top_level_holds_few_modules():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 12, f"{len(top)} modules at the top of titanrush/: {top}; group them in a subpackage"


def test_parallel_imports_no_model_data_or_trainer():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("titanrush.parallel."):
            bad = {
                m
                for m in _imports(path, modules)
                if m.startswith(
                    ("titanrush.models", "titanrush.data", "titanrush.trainer", "titanrush.run.plan")
                )
            }
            assert not bad, (name, bad)


def test_no_private_attribute_of_another_object_is_written():
    """No `obj._name = ...` (or `setattr(obj, "_name", ...)`) on anything but the object's own class's
    instance: patching torch's or torchao's internals is what the product must not do by default."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr.startswith("_")
                    and not t.attr.startswith("__")
                    and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(t)}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_")
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders
