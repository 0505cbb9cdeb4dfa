"""The tree's shape (docs/architecture.md): layers import downwards only, no import cycle, no private
attribute of another object or imported module written."""

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
        "titanrush.clip_adamw",
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


# The writes into other code's state that the product makes on purpose, keyed by what is written (as the
# check below prints it), each with why it is allowed.
ALLOW = {
    "torch.backends.cudnn.benchmark": "public torch knob (docs: Reproducibility), off in deterministic runs",
    "torch.backends.cuda.matmul.allow_tf32": "public torch knob (docs: TF32), off: fp32 is measured as fp32",
    "torch.backends.cudnn.allow_tf32": "public torch knob (docs: TF32), off: fp32 is measured as fp32",
    "warnings.showwarning": "the stdlib's documented hook; set only by init_logging, which the CLI calls",
    "torch._dynamo.config.recompile_limit": "the knob torch's recompile warning names; raised, never lowered",
    # (the launcher's own environment, which torchrun hands to the workers it starts: a restart's word)
    "os.environ[RESTART_VARS[0]]": "the launcher tells a restarted job its restart's number (launch.py)",
    "os.environ[RESTART_VARS[1]]": "the launcher tells a restarted job its restart's cause (launch.py)",
    # (in the child the launcher forks for the config check, which ends when the check does)
    "sys.argv": "the launcher's check runs titanrush.train as `python -m` would, with --check (launch.py)",
}
# Writes that are problems (reported in #46): listed so that the check stays on, to be removed with them.
TO_FIX: dict[str, str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _is_chain(node: ast.expr) -> bool:
    """A name or a chain of attributes (`torch._dynamo.config`): no call, no subscript."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _flat(targets: list[ast.expr]) -> list[ast.expr]:
    """Assignment targets with tuples, lists and starred names unpacked."""
    out = []
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            out += _flat(t.elts)
        else:
            out.append(t.value if isinstance(t, ast.Starred) else t)
    return out


def _attr_name(node: ast.expr) -> str | None:
    """The attribute a setattr call names: a string, or an f-string's leading text (`f"_{x}"`: `_...`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return f"{node.values[0].value}..."
    return None


class _Writes(ast.NodeVisitor):
    """The writes of one source file into state that is not its own:

    - a private attribute (`_x`) of any object but `self` / `cls`, assigned, deleted or set by `setattr`,
      `delattr` or `__setattr__`;
    - any attribute or item of an imported module or object, or of anything reached through one by
      attributes (`torch._dynamo.config.x = ...`, `F.gelu = ...` after `import torch.nn.functional as F`,
      `warnings.showwarning = ...`, `setattr(torch.nn, "x", ...)`, `cfg.x = ...` after
      `cfg = torch._dynamo.config`).

    Names are resolved per function scope: a parameter or local that shadows an imported name is local.
    """

    def __init__(self) -> None:
        self.scopes: list[dict[str, bool]] = []  # name -> whether it names an import (or a chain of one)
        self.found: list[tuple[int, str]] = []  # (line, what is written)

    def _imported(self, node: ast.expr) -> bool:
        root = _root(node)
        if not isinstance(root, ast.Name):
            return False
        scope = next((s for s in reversed(self.scopes) if root.id in s), {})
        return scope.get(root.id, False)

    def _enter(self, body: list[ast.stmt], args: ast.arguments | None = None) -> None:
        """A new scope with the names its body binds (not entering nested functions and classes)."""
        scope: dict[str, bool] = {}
        self.scopes.append(scope)
        if args is not None:
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None:
                    scope[a.arg] = False
        todo: list[ast.AST] = list(body)
        while todo:
            node = todo.pop(0)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope.setdefault(node.name, False)
                continue
            if isinstance(node, ast.Lambda):
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    scope[(alias.asname or alias.name).split(".")[0]] = True
            elif isinstance(node, ast.Assign) and _is_chain(node.value) and self._imported(node.value):
                scope.update({t.id: True for t in node.targets if isinstance(t, ast.Name)})
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                scope.setdefault(node.id, False)
            todo.extend(ast.iter_child_nodes(node))

    def visit_Module(self, node: ast.Module) -> None:
        self._enter(node.body)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._enter(node.body, node.args)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _check(self, line: int, obj: ast.expr, attr: str | None, shown: str) -> None:
        if (attr is not None and _private(attr) and not _is_self(obj)) or self._imported(obj):
            self.found.append((line, shown))

    def _target(self, line: int, t: ast.expr) -> None:
        if isinstance(t, ast.Attribute):
            self._check(line, t.value, t.attr, ast.unparse(t))
        elif isinstance(t, ast.Subscript) and _is_chain(t.value):
            self._check(line, t.value, None, ast.unparse(t))

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in _flat(node.targets):
            self._target(node.lineno, t)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign | ast.AnnAssign) -> None:
        self._target(node.lineno, node.target)
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in _flat(node.targets):
            self._target(node.lineno, t)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f, args = node.func, node.args
        obj = name = None
        if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and len(args) >= 2:
            obj, name = args[0], args[1]  # setattr(obj, "x", value)
        elif isinstance(f, ast.Attribute) and f.attr in ("__setattr__", "__delattr__") and args:
            if isinstance(f.value, ast.Name) and f.value.id == "object" and len(args) >= 2:
                obj, name = args[0], args[1]  # object.__setattr__(obj, "x", value)
            else:
                obj, name = f.value, args[0]  # obj.__setattr__("x", value)
        if obj is not None:
            attr = _attr_name(name)
            self._check(node.lineno, obj, attr, f"{ast.unparse(obj)}.{attr}" if attr else ast.unparse(node))
        self.generic_visit(node)


def _writes(source: str) -> list[tuple[int, str]]:
    """(line, what) of each write of `source` into state that is not its own (`_Writes`)."""
    writes = _Writes()
    writes.visit(ast.parse(source))
    return writes.found


def test_the_write_check_flags_every_spelling_of_a_patch():
    """The check itself: each spelling of a patch is flagged, and an object's own or local state is not."""
    patches = """
import warnings
import torch
import torch.nn.functional as F
from torch._dynamo import config as dynamo_config
from somewhere import thing

warnings.showwarning = print
torch._dynamo.config.recompile_limit = 64
torch.foo._bar = 1
F.gelu = None
dynamo_config.cache_size_limit += 1
sys_modules = torch.nn
sys_modules.Linear = None
thing.value, other = 1, 2
del torch.nn.functional.silu
torch.library.registry["op"] = None


def f(model, name):
    import torch.distributed as dist

    dist.all_reduce = None
    setattr(torch.nn, name, None)
    model._hidden = 1
    model.inner._hidden = 1
    setattr(model, "_hidden", 1)
    setattr(model, f"_{name}", 1)
    object.__setattr__(model, "_frozen", 1)
    model.__setattr__("_hidden", 1)
"""
    flagged = [what for _, what in _writes(patches)]
    assert flagged == [
        "warnings.showwarning",
        "torch._dynamo.config.recompile_limit",
        "torch.foo._bar",
        "F.gelu",
        "dynamo_config.cache_size_limit",
        "sys_modules.Linear",
        "thing.value",
        "torch.nn.functional.silu",
        "torch.library.registry['op']",
        "dist.all_reduce",
        "setattr(torch.nn, name, None)",
        "model._hidden",
        "model.inner._hidden",
        "model._hidden",
        "model._...",
        "model._frozen",
        "model._hidden",
    ]
    own = """
import torch


class Layer:
    def __init__(self, config):
        self._cache = None
        self.weight = torch.zeros(3)
        config.steps = 3  # a parameter that shadows no import: the caller's object


def g(torch, cfg):
    torch.x = 1  # a parameter named like a module
    cfg.training.steps = 3
    out = torch.zeros(2)
    out.grad = None
    setattr(cfg, "steps", 4)
"""
    assert _writes(own) == []


def test_no_private_attribute_of_another_object_or_imported_module_is_written():
    """Patching torch's, torchao's or the stdlib's state (or another object's privates) is what the product
    must not do, unless ALLOW says why; an entry that matches nothing any more must go."""
    seen, unexpected = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, what in _writes(path.read_text()):
            seen.add(what)
            if what not in ALLOW and what not in TO_FIX:
                unexpected.append(f"{path.relative_to(ROOT)}:{line} writes {what}")
    assert not unexpected, "\n".join(unexpected)
    stale = (set(ALLOW) | set(TO_FIX)) - seen
    assert not stale, f"entries that match no write any more: remove them from ALLOW / TO_FIX: {stale}"


def test_test_files_have_distinct_names():
    """pytest imports test modules by their file name (the test folders are not packages): two files of
    one name in different folders stop the whole suite at collection."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]}: rename one"
        seen[path.name] = path
