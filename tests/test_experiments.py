"""lab.experiments' shared run(), what the chapters may import, and the library pieces the chapters use:
lab.kernels.pages.paged_copy.

Oracles: a call log for run(); for paged_copy, the definition of a block table (position t of sequence b
sits in page tables[b, t // page_size] at offset t % page_size), checked slot by slot.
"""

import ast
import types

import pytest
import torch

from lab import experiments
from lab.kernels.pages import paged_copy
from lab.results import REPO_ROOT


def test_run_measures_then_records_and_returns_the_measurements():
    log = []
    chapter = types.SimpleNamespace(measure=lambda quick_mode: log.append(("measure", quick_mode)) or {"x": 1},
                                    record=lambda m: log.append(("record", m)))
    assert experiments.run(chapter, quick_mode=True) == {"x": 1}
    assert log == [("measure", True), ("record", {"x": 1})]


def test_run_by_name_knows_the_chapters():
    assert experiments.chapter("ch02").__name__ == "lab.experiments.ch02_build"
    with pytest.raises(ValueError, match="unknown chapter 'ch99'"):
        experiments.run("ch99")


def _imports(path) -> set:
    """Every module `path` imports, at the top or inside a function, as absolute names (lab.x.y)."""
    package = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts[:-1])         # lab.experiments
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(x for x in (base, node.module) if x)
            out |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return out


def test_nothing_outside_the_exercises_imports_them():
    """The exercises check a reader against the library; the library and the chapters never depend on
    them. (lab.exercises.ch03 and lab.experiments.ch03_savings imported each other: the FLOP counter both
    use lives in lab.step_cost.)"""
    offenders = {str(p.relative_to(REPO_ROOT)): sorted(m for m in _imports(p) if m.startswith("lab.exercises"))
                 for p in (REPO_ROOT / "lab").rglob("*.py") if "exercises" not in p.parts}
    assert {p: m for p, m in offenders.items() if m} == {}


@pytest.mark.parametrize("L, page_size", [(1, 16), (16, 16), (37, 16), (37, 1), (5, 64)])
def test_paged_copy_puts_every_position_where_its_block_table_says(L, page_size):
    B, H, D = 3, 2, 4
    g = torch.Generator().manual_seed(L)
    k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    k_pool, v_pool, tables, lengths = paged_copy(k, v, page_size, g)
    P = -(-L // page_size)
    assert k_pool.shape == v_pool.shape == (B * P, page_size, H, D)
    assert tables.dtype == lengths.dtype == torch.int32 and tables.shape == (B, P) and lengths.tolist() == [L] * B
    assert sorted(tables.flatten().tolist()) == list(range(B * P))          # every page used exactly once
    for b in range(B):
        for t in range(P * page_size):
            page, offset = tables[b, t // page_size], t % page_size
            want_k, want_v = (k[b, :, t], v[b, :, t]) if t < L else (torch.zeros(H, D), torch.zeros(H, D))
            assert torch.equal(k_pool[page, offset], want_k) and torch.equal(v_pool[page, offset], want_v)
