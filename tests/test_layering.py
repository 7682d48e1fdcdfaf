"""The layering of lab: what each part may know of the others, read from the source itself.

Oracle: the source. The forwards (lab/models) import nothing from lab/cache and call only the protocol's
methods on a cache; the caches (lab/cache) import nothing from lab/models or lab/engine; the kernels
(lab/kernels) import nothing from the rest of lab (a cache calls a kernel, never the other way round); no
code outside lab/cache reads a cache's storage (see POOL_ATTRIBUTES); and no module of lab imports, however
indirectly or late (inside a function), a module that imports it back. Each checker is also run on a
snippet that breaks its rule, so that it can fail.
"""

import ast
import re
from pathlib import Path

LAB = Path(__file__).resolve().parent.parent / "lab"
PROTOCOL = {"check_model", "max_length", "next_positions", "attend", "advance"}  # what a forward may call

# A cache's storage and the tables that locate positions in it: the pools `[L, pages, page_size, H_kv, D]`,
# the block-table and length buffers a decode kernel reads, the slot mapping of a step, and the block
# manager's private lists. Only lab/cache reads or writes them as attributes; a kernel takes them as
# arguments (parameters of those names are fine), and the block manager's public host-side queries
# (`block_table(seq)`, a copy of a list) are fine too.
POOL_ATTRIBUTES = {"k_pool", "v_pool", "block_tables", "slot_mapping", "_tables", "_free", "_refs"}
# lab/exercises hands the reader a pool on purpose: chapter 8's swapping exercise copies pages to the host
# and back by hand, as chapter 5's notebook builds a pool by hand. Everything else in lab is held to the rule.
POOL_EXEMPT = ("cache", "exercises")


def module_name(path: Path) -> str:
    parts = ["lab", *path.relative_to(LAB).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the lab modules a file imports anywhere in it (relative imports resolved)."""
    return imports_of(module_name(path), path.name == "__init__.py", path.read_text())


def imports_of(name: str, is_package: bool, source: str) -> set[str]:
    """The same for the source of module `name` (a package's __init__ when is_package)."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {n for n in names if n == "lab" or n.startswith("lab.")}


def pool_access(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every read or write of a POOL_ATTRIBUTES attribute in `source`."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in POOL_ATTRIBUTES]


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the lab modules it makes Python run: the ones it names, and the packages above them (their
    __init__ runs first), except the packages the importer itself is inside (already running)."""
    modules = set(files)
    graph = {}
    for name, path in files.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        edges = set()
        for m in imports_of(name, Path(path[0]).name == "__init__.py", path[1]):
            while m not in modules:                    # `from .x import name`: the module is .x
                m = m.rpartition(".")[0]
            parts = m.split(".")
            edges |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} - own
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(part)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def lab_files() -> dict[str, tuple[Path, str]]:
    return {module_name(p): (p, p.read_text()) for p in LAB.rglob("*.py")}


def test_models_do_not_import_the_cache_and_the_cache_not_the_models():
    for path in (LAB / "models").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(("lab.cache", "lab.engine"))}
        assert not bad, f"{path.name} imports {sorted(bad)}: the forwards know only the cache protocol"
    for path in (LAB / "cache").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(("lab.models", "lab.engine"))}
        assert not bad, f"cache/{path.name} imports {sorted(bad)}: a cache knows nothing of the model"


def test_the_kernels_import_nothing_from_the_rest_of_lab():
    for path in (LAB / "kernels").glob("*.py"):
        bad = {m for m in imported_modules(path) if not m.startswith("lab.kernels")}
        assert not bad, f"kernels/{path.name} imports {sorted(bad)}: a kernel takes pools as arguments"


def test_the_forwards_call_only_the_protocol_on_a_cache():
    for path in (LAB / "models").glob("*.py"):
        used = set(re.findall(r"\bcache\.(\w+)", path.read_text()))
        assert used <= PROTOCOL, f"{path.name} uses cache.{sorted(used - PROTOCOL)}, outside the protocol"
        assert "hasattr(cache" not in path.read_text(), f"{path.name} branches on what the cache has"


def test_only_the_cache_touches_pools_and_block_tables():
    for name, (path, source) in lab_files().items():
        if name.split(".")[1:2] and name.split(".")[1] in POOL_EXEMPT:
            continue
        found = pool_access(source)
        assert not found, f"{path.relative_to(LAB.parent)} reads a cache's storage at (line, attribute) {found}"


def test_no_import_cycles_in_lab():
    found = cycles(import_graph(lab_files()))
    assert not found, f"modules that import each other, directly or through others: {found}"


# ---- the checkers themselves can fail

def test_imported_modules_resolves_relative_imports():
    found = imported_modules(LAB / "cache" / "paged.py")
    assert "lab.cache.block_manager" in found and "lab.kernels" in found


def test_pool_access_finds_a_read_and_a_write_but_not_a_parameter():
    snippet = ("def f(engine, k_pool, block_tables):\n"
               "    x = engine.pool.k_pool[:, 3]\n"
               "    engine.pool.block_tables[0] = 1\n"
               "    return k_pool, block_tables, engine.manager.block_table(0)\n")
    assert pool_access(snippet) == [(2, "k_pool"), (3, "block_tables")]


def test_cycles_finds_a_cycle_hidden_by_a_deferred_import_and_a_package_init():
    files = {"lab.k": ("lab/k.py", "from .c.quant import q\n"),          # kernels -> cache.quant ...
             "lab.c": ("lab/c/__init__.py", "from .paged import P\n"),   # ... whose package runs paged
             "lab.c.quant": ("lab/c/quant.py", "import torch\n"),
             "lab.c.paged": ("lab/c/paged.py", "def f():\n    from ..k import attend\n")}  # deferred
    assert cycles(import_graph(files)) == [{"lab.k", "lab.c", "lab.c.paged"}]
    files["lab.k"] = ("lab/k.py", "import torch\n")
    assert cycles(import_graph(files)) == []
