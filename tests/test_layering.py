"""The layering between the model and the cache: each knows only the other's protocol.

Oracle: the source itself. The forwards (lab/models) import nothing from lab/cache and call only the
protocol's methods on a cache; the caches (lab/cache) import nothing from lab/models or lab/engine.
"""

import ast
import re
from pathlib import Path

LAB = Path(__file__).resolve().parent.parent / "lab"
PROTOCOL = {"check_model", "max_length", "next_positions", "attend", "advance"}  # what a forward may call


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the lab modules a file imports (relative imports resolved)."""
    package = ["lab", *path.relative_to(LAB).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {n for n in names if n == "lab" or n.startswith("lab.")}


def test_models_do_not_import_the_cache_and_the_cache_not_the_models():
    for path in (LAB / "models").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(("lab.cache", "lab.engine"))}
        assert not bad, f"{path.name} imports {sorted(bad)}: the forwards know only the cache protocol"
    for path in (LAB / "cache").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(("lab.models", "lab.engine"))}
        assert not bad, f"cache/{path.name} imports {sorted(bad)}: a cache knows nothing of the model"


def test_the_forwards_call_only_the_protocol_on_a_cache():
    for path in (LAB / "models").glob("*.py"):
        used = set(re.findall(r"\bcache\.(\w+)", path.read_text()))
        assert used <= PROTOCOL, f"{path.name} uses cache.{sorted(used - PROTOCOL)}, outside the protocol"
        assert "hasattr(cache" not in path.read_text(), f"{path.name} branches on what the cache has"


def test_imported_modules_resolves_relative_imports():  # the checker itself can fail
    found = imported_modules(LAB / "cache" / "paged.py")
    assert "lab.cache.block_manager" in found and "lab.kernels" in found
