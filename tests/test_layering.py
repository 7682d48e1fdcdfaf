"""The layering of lab: what each part may know of the others, read from the source itself.

Oracle: the source. The forwards (lab/models) import nothing from lab/cache and call only the protocol's
methods on a cache; the caches (lab/cache) import nothing from lab/models or lab/engine; the kernels
(lab/kernels) import nothing from the rest of lab (a cache calls a kernel, never the other way round); no
code outside lab/cache, the exercises included, reads a cache's storage or a block manager's private state
(see POOL_ATTRIBUTES); the core (lab/cache, engine, models, kernels, serve) never imports, however indirectly
or late, the chapters' code, the peers or the book's tooling (see NOT_CORE); and no module of lab imports,
however indirectly or late (inside a function), a module that imports it back. Each checker is also run on a
snippet that breaks its rule, so that it can fail.
"""

import ast
import re
from pathlib import Path

LAB = Path(__file__).resolve().parent.parent / "lab"
PROTOCOL = {"check_model", "max_length", "next_positions", "attend", "advance"}  # what a forward may call

# A cache's storage and the tables that locate positions in it: the pools `[L, pages, page_size, H_kv, D]` (a
# hybrid pool's `k_pools` and `v_pools`, one per group of layers), the block-table and length buffers a decode
# kernel reads and their host copies (`_tables`, `_lengths`), the slot mapping of a step, and the block
# manager's private state (its tables, free list, reference counts and lengths, and the prefix cache's maps
# digest -> page, `_cached`, and page -> key, `_keys`). Only lab/cache reads or writes them. Everything else in
# lab, lab/exercises included, goes through the public API: a pool's `page(page)` (a copy of one page in every
# layer) and `set_page(page, kv)`, the manager's `block_table(seq)`, `slots(...)`, `refs(page)`, `cached(key)`,
# `named_tokens()`, `cached_pages()`. A kernel takes the pools as arguments (parameters of those names are fine).
POOL_ATTRIBUTES = {"k_pool", "v_pool", "k_pools", "v_pools", "block_tables", "slot_mapping",
                   "_tables", "_free", "_refs", "_lengths", "_keys", "_cached"}
# What counts as touching one (pool_access): `x.name` read, written or deleted, and getattr / setattr / hasattr /
# delattr(x, "name"), on anything but a class's own attribute. A class outside lab/cache may keep its own
# `_lengths` or `_keys`: `self.name` is its own inside a method of a class that itself assigns `self.name`
# (in any of its methods) and derives from no class imported from lab.cache. So a subclass of BlockManager
# reading `self._free` is caught (it reads the manager's private state, inherited), and so is `self.pool.k_pool`
# (the attribute of another object), `other._lengths` and a mixin's `self._lengths` that its class never sets.
POOL_OWNER = "lab.cache"


# The core, what a server or a notebook needs to run a model over a cache, and the modules it never imports:
# the chapters' experiments and exercises, the peers' drivers, and the book's tooling (the package lab/book, and
# lab/claims.py, readme.py, verdicts.py while they move into it). A name is outside the core when it equals one
# of NOT_CORE or lies inside it (`lab.book.render`; not `lab.bookkeeping`). The imports are followed through
# every module they run, deferred ones and packages' __init__ included, and a name that no file of lab holds
# (a module moved away) still counts.
CORE = ("cache", "engine", "models", "kernels", "serve")
NOT_CORE = ("lab.experiments", "lab.exercises", "lab.peers", "lab.book", "lab.claims", "lab.readme", "lab.verdicts")


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


def pool_access(source: str, name: str = "lab.snippet", is_package: bool = False) -> list[tuple[int, str]]:
    """(line, attribute) of every read or write of a POOL_ATTRIBUTES attribute in `source`, the source of module
    `name`, but a class's own (see the comment on POOL_ATTRIBUTES), in line order."""
    tree = ast.parse(source)
    cache_names = set()                                # names the module binds to lab.cache's modules or classes
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found = imports_of(name, is_package, ast.unparse(node))
            if any(m == POOL_OWNER or m.startswith(POOL_OWNER + ".") for m in found):
                cache_names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    own = set()                                        # ids of the nodes that touch a class's own attribute
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if any(ast.unparse(b).split(".")[0] in cache_names for b in cls.bases):
            continue                                   # a cache's subclass: its attributes are the cache's
        accesses = [(n, a) for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and f.args.args for n, a in _attributes_of(f, f.args.args[0].arg)]
        assigned = {a for n, a in accesses if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store))
                    or (isinstance(n, ast.Call) and n.func.id == "setattr")}
        own |= {id(n) for n, a in accesses if a in assigned}
    found = [(n, a) for n, a in _attributes_of(tree) if a in POOL_ATTRIBUTES and id(n) not in own]
    return [(n.lineno, a) for n, a in sorted(found, key=lambda f: (f[0].lineno, f[0].col_offset))]


def _attributes_of(node, on: str | None = None):
    """(node, attribute name) of every `x.attr` and getattr-like call with a constant name under `node`, x the
    name `on` (any x when None); when `on` is given, classes nested inside are skipped (their `self` is theirs)."""
    for child in ast.iter_child_nodes(node):
        if on is not None and isinstance(child, ast.ClassDef):
            continue
        if isinstance(child, ast.Attribute):
            target, attr = child.value, child.attr
        elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and len(child.args) >= 2
              and child.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and isinstance(child.args[1], ast.Constant) and isinstance(child.args[1].value, str)):
            target, attr = child.args[0], child.args[1].value
        else:
            target = None
        if target is not None and (on is None or isinstance(target, ast.Name) and target.id == on):
            yield child, attr
        yield from _attributes_of(child, on)


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the lab modules it makes Python run: the ones it names, and the packages above them (their
    __init__ runs first), except the packages the importer itself is inside (already running)."""
    modules = set(files)
    graph = {}
    for name, path in files.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        edges = set()
        for m in imports_of(name, Path(path[0]).name == "__init__.py", path[1]):
            while m and m not in modules:              # `from .x import name`: the module is .x
                m = m.rpartition(".")[0]
            if not m:
                continue                               # no file holds it (nor a package above it)
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


def leaks_from_core(files: dict[str, tuple]) -> dict[str, list[str]]:
    """Core module -> the chain of modules through which it imports one outside the core (NOT_CORE), its last
    entry the name imported; only the core modules that do. A module runs the packages above it first, so they
    start the search too."""
    graph, out = import_graph(files), {}
    named = {m: imports_of(m, Path(path).name == "__init__.py", source) for m, (path, source) in files.items()}
    for start in sorted(m for m in files if m.split(".")[1:2] and m.split(".")[1] in CORE):
        parts = start.split(".")
        chain = {".".join(parts[:i]): [".".join(parts[:i])] for i in range(1, len(parts) + 1)}
        queue = list(chain)
        while queue and start not in out:
            m = queue.pop(0)
            bad = sorted(n for n in named.get(m, ()) if any(n == p or n.startswith(p + ".") for p in NOT_CORE))
            if bad:
                out[start] = chain[m] + [bad[0]]
            for w in sorted(graph.get(m, ())):
                if w not in chain:
                    chain[w] = chain[m] + [w]
                    queue.append(w)
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
        if name == POOL_OWNER or name.startswith(POOL_OWNER + "."):
            continue
        found = pool_access(source, name, path.name == "__init__.py")
        assert not found, (f"{path.relative_to(LAB.parent)} reads a cache's storage or a block manager's private "
                           f"state at (line, attribute) {found}: use the public API (see POOL_ATTRIBUTES)")


def test_the_core_never_imports_the_chapters_the_peers_or_the_book():
    found = leaks_from_core(lab_files())
    assert not found, "core modules that import, through the chain shown, a module outside the core: " + "; ".join(
        f"{m}: {' -> '.join(chain)}" for m, chain in found.items())


def test_no_import_cycles_in_lab():
    found = cycles(import_graph(lab_files()))
    assert not found, f"modules that import each other, directly or through others: {found}"


# ---- the checkers themselves can fail

def test_imported_modules_resolves_relative_imports():
    found = imported_modules(LAB / "cache" / "pool.py")
    assert "lab.cache.block_manager" in found and "lab.kernels" in found


def test_pool_access_finds_a_read_and_a_write_but_not_a_parameter():
    snippet = ("def f(engine, k_pool, block_tables):\n"
               "    x = engine.pool.k_pool[:, 3]\n"
               "    engine.pool.block_tables[0] = 1\n"
               "    return k_pool, block_tables, engine.manager.block_table(0)\n")
    assert pool_access(snippet) == [(2, "k_pool"), (3, "block_tables")]


def test_pool_access_finds_a_managers_private_state_but_not_a_class_of_its_own():
    snippet = ("from ..cache import BlockManager as BM\n"
               "class Mine:\n"
               "    def __init__(self):\n"
               "        self._lengths, self._keys = [], {}\n"            # its own: fine
               "    def total(me, other):\n"
               "        return sum(me._lengths), other._lengths\n"        # line 6: me's is its own, other's not
               "class Mixin:\n"
               "    def n(self):\n"
               "        return len(self._lengths)\n"                     # line 9: never set by Mixin
               "class LFU(BM):\n"
               "    def __init__(self):\n"
               "        self._free = {}\n"                               # line 12: a manager's, inherited
               "def f(engine, manager):\n"
               "    k = engine.pool.k_pools[0]\n"                        # line 14: a hybrid pool
               "    return getattr(manager, '_cached'), manager.cached(k)\n")   # line 15
    found = pool_access(snippet, "lab.exercises.snippet")
    assert found == [(6, "_lengths"), (9, "_lengths"), (12, "_free"), (14, "k_pools"), (15, "_cached")]


def test_leaks_from_core_follows_deferred_imports_packages_and_moved_modules():
    files = {"lab": ("lab/__init__.py", ""),
             "lab.engine": ("lab/engine/__init__.py", "from .serving import S\n"),
             "lab.engine.serving": ("lab/engine/serving.py", "def f():\n    from ..metrics import m\n"),  # deferred
             "lab.metrics": ("lab/metrics.py", "from lab.book.render import table\n"),
             "lab.book": ("lab/book/__init__.py", ""),
             "lab.book.render": ("lab/book/render.py", "import lab.engine\n"),
             "lab.cache": ("lab/cache/__init__.py", "import lab.bookkeeping\n"),     # not the book
             "lab.bookkeeping": ("lab/bookkeeping.py", "def g():\n    import lab.claims\n"),  # moved away
             "lab.models": ("lab/models/__init__.py", "from ..experiments import ch01\n")}
    assert leaks_from_core(files) == {
        "lab.cache": ["lab.cache", "lab.bookkeeping", "lab.claims"],
        "lab.engine": ["lab.engine", "lab.engine.serving", "lab.metrics", "lab.book.render"],
        "lab.engine.serving": ["lab.engine.serving", "lab.metrics", "lab.book.render"],
        "lab.models": ["lab.models", "lab.experiments"]}
    files["lab.metrics"] = ("lab/metrics.py", "import torch\n")
    files["lab.bookkeeping"] = ("lab/bookkeeping.py", "")
    assert leaks_from_core(files) == {"lab.models": ["lab.models", "lab.experiments"]}


def test_cycles_finds_a_cycle_hidden_by_a_deferred_import_and_a_package_init():
    files = {"lab.k": ("lab/k.py", "from .c.quant import q\n"),          # kernels -> cache.quant ...
             "lab.c": ("lab/c/__init__.py", "from .paged import P\n"),   # ... whose package runs paged
             "lab.c.quant": ("lab/c/quant.py", "import torch\n"),
             "lab.c.paged": ("lab/c/paged.py", "def f():\n    from ..k import attend\n")}  # deferred
    assert cycles(import_graph(files)) == [{"lab.k", "lab.c", "lab.c.paged"}]
    files["lab.k"] = ("lab/k.py", "import torch\n")
    assert cycles(import_graph(files)) == []
