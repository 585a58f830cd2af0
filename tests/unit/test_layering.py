"""The import rules of tests/CONTRIBUTING.md, checked on every import of every module (lazy ones
included): no upward import, no cycle, no private name across modules, no re-export."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("data_pipeline", "pretrain", "launch")
# thin modules at documented paths: they exist to hand names on
PUBLIC = {"pretrain.model", "pretrain.flops", "pretrain.export", "data_pipeline.write_shards", "pretrain.config"}


def floors() -> list[list[str]]:
    text = (REPO / "tests" / "CONTRIBUTING.md").read_text()
    block = re.search(r"```floors\n(.*?)```", text, re.S).group(1)
    return [line.split() for line in block.splitlines() if line.strip()]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            mod = ".".join(p.relative_to(REPO).with_suffix("").parts)
            out[mod.removesuffix(".__init__")] = p
    return out


MODULES = modules()


def resolve(name: str) -> str | None:
    """The project module a dotted import name lands in (a name inside a module: that module)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def imports(mod: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every project import in ``mod``."""
    tree = ast.parse(MODULES[mod].read_text())
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name, []) for a in n.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(n, ast.ImportFrom):
            assert n.level == 0, f"{mod}:{n.lineno}: relative import"
            if n.module and n.module.split(".")[0] in PACKAGES:
                out.append((n.lineno, n.module, [a.name for a in n.names]))
    return out


def floor_of(mod: str, table: list[list[str]]) -> int:
    best, level = -1, None
    for i, names in enumerate(table):
        for prefix in names:
            if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{mod} is on no floor of tests/CONTRIBUTING.md"
    return level


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for mod in MODULES:
        for _, target, names in imports(mod):
            for dotted in [target] + [f"{target}.{n}" for n in names]:
                dest = resolve(dotted)
                if dest and dest != mod and not mod.startswith(dest + "."):  # a package's own __init__
                    graph[mod].add(dest)
    return graph


def test_every_module_is_on_a_floor_and_imports_only_downward():
    table = floors()
    up = []
    for mod in MODULES:
        for line, target, names in imports(mod):
            for dotted in [target] + [f"{target}.{n}" for n in names]:
                dest = resolve(dotted)
                if dest and floor_of(dest, table) > floor_of(mod, table):
                    up.append(f"{MODULES[mod].relative_to(REPO)}:{line} imports {dest} (a higher floor)")
    assert not up, "\n".join(sorted(set(up)))


def test_no_import_cycle():
    graph = edges()
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            visit(d)
        stack.pop()

    for m in sorted(MODULES):
        visit(m)
    assert not cycles, "\n".join(cycles)


def test_no_private_name_crosses_a_module():
    bad = []
    for mod, path in MODULES.items():
        aliases = {}  # local name -> project module, for `from pkg import mod` and `import a.b as x`
        for line, target, names in imports(mod):
            bad += [f"{path.relative_to(REPO)}:{line} imports {target}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
            for n in names:
                if f"{target}.{n}" in MODULES:
                    aliases[n] = f"{target}.{n}"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.alias) and node.asname and resolve(node.name) == node.name:
                aliases[node.asname] = node.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def _defined(mod: str) -> set[str]:
    names = set()
    for n in ast.walk(ast.parse(MODULES[mod].read_text())):
        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
    return names


@pytest.mark.parametrize("where", ["pretrain", "data_pipeline", "launch", "tests", "benchmarks"])
def test_names_are_imported_from_the_module_that_defines_them(where):
    """``from a import x`` where ``a`` only imports ``x`` itself is a re-export: import it from its
    owner (the public modules at old paths excepted)."""
    files = sorted((REPO / where).rglob("*.py"))
    bad = []
    for path in files:
        for n in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(n, ast.ImportFrom) and n.module and n.module in MODULES) or n.module in PUBLIC:
                continue
            if MODULES[n.module].name == "__init__.py":
                continue
            defined = _defined(n.module)
            for a in n.names:
                if a.name not in defined and f"{n.module}.{a.name}" not in MODULES:
                    bad.append(f"{path.relative_to(REPO)}:{n.lineno} takes {a.name} from {n.module}, "
                               "which only imports it")
    assert not bad, "\n".join(bad)


def test_package_folders_stay_small():
    """No package folder holds more than 15 modules."""
    crowded = {}
    for init in REPO.glob("*/**/__init__.py"):
        if init.parts[len(REPO.parts)] in PACKAGES:
            n = len(list(init.parent.glob("*.py")))
            if n > 15:
                crowded[str(init.parent.relative_to(REPO))] = n
    assert not crowded, crowded
