"""`python -m lab.campaign` (`make results-status`): where every section of results/results.json stands.

For each section: the commit that measured it, whether its working tree was clean, whether the code the
section runs (`sources`: the lab modules its experiment imports or starts, read from the code) has changed
since that commit, the machine, the mode and the wall time. A change that leaves the syntax tree of every
changed Python file the same once docstrings are set aside (comments never reach it) reads "docs only": the
code that ran is the code there is now. `problems(doc)` names what a committed results file must not hold: a
section measured on a dirty tree, or at a commit that is not an ancestor of HEAD (tests/test_results.py holds
the file to it).
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

from .experiments import CHAPTERS
from .results import COMMITTED, REPO_ROOT, read

SHARED = ["lab", ":(exclude)lab/book", ":(exclude)lab/exercises", ":(exclude)lab/experiments",
          "lab/experiments/__init__.py", "lab/experiments/plots.py", "lab/experiments/tables.py"]
MODULE = re.compile(r"lab(\.\w+)+")     # a module started by name: [sys.executable, "-m", "lab.serve", ...]
SCRIPT = re.compile(r"\w+\.py")         # a script beside the module that names it: with_name("kvpress_run.py")


def _file(module: str) -> Path | None:
    base = REPO_ROOT.joinpath(*module.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def closure(path: Path) -> set[Path]:
    """The files of lab a module runs: its own, the lab modules it imports, those it starts by name (`-m
    lab.x`) or as a script beside it, their packages' __init__.py, and so on. Read from the code, not run."""
    seen, todo = set(), [path]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        package = list(f.relative_to(REPO_ROOT).parts[:-1])          # lab/x/y.py and lab/x/__init__.py: lab.x
        names = [".".join(package[:i]) for i in range(1, len(package) + 1)]  # the packages above it run too
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                base = ".".join(base + (node.module.split(".") if node.module else []))
                names += [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if MODULE.fullmatch(node.value):
                    names += [node.value, f"{node.value}.__main__"]
                elif SCRIPT.fullmatch(node.value) and (f.parent / node.value).is_file():
                    todo.append(f.parent / node.value)
        todo += [m for m in map(_file, (n for n in names if n == "lab" or n.startswith("lab."))) if m]
    return seen


def sources(section: str) -> list[str]:
    """The git pathspecs of the code section `section` runs: its experiment module's `closure` and the results
    schema; for "notebooks", all of lab but the book tooling, the exercises and the other experiments, and
    the notebooks (a notebook imports what it likes)."""
    if section == "notebooks":
        return SHARED + ["lab/experiments/notebooks.py", "lab/results.schema.json", "notebooks"]
    name = section.removesuffix("_gpu")
    module = "gpu" if section.endswith("_gpu") else CHAPTERS.get(name, name)
    files = closure(REPO_ROOT / "lab" / "experiments" / f"{module}.py")
    return sorted(str(f.relative_to(REPO_ROOT)) for f in files) + ["lab/results.schema.json"]


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)


def is_ancestor(commit: str) -> bool | None:
    """Whether `commit` is HEAD or an ancestor of it; None when git cannot say (no repository, no commit)."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return False if _git("rev-parse", "HEAD").returncode == 0 else None
    return _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0


def same_code(old: str | None, new: str | None) -> bool:
    """Whether two versions of a Python file differ only in docstrings and comments (None: no such file)."""
    def tree(text):
        t = ast.parse(text)
        for node in ast.walk(t):
            body = getattr(node, "body", None)
            if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        return ast.dump(t)
    if old is None or new is None:
        return old is new
    try:
        return tree(old) == tree(new)
    except SyntaxError:
        return False


def changed_since(commit: str, section: str) -> bool | str | None:
    """Whether the code `section` runs differs between `commit` and HEAD: True, "docs" when every changed file
    is Python whose code is the same (`same_code`), False when nothing changed (None: git cannot say)."""
    r = _git("diff", "--name-only", commit, "HEAD", "--", *sources(section))
    if r.returncode:
        return None
    files = r.stdout.split()
    if not files:
        return False

    def show(rev, path):
        out = _git("show", f"{rev}:{path}")
        return out.stdout if out.returncode == 0 else None
    docs = all(f.endswith(".py") and same_code(show(commit, f), show("HEAD", f)) for f in files)
    return "docs" if docs else True


def status(doc=None) -> list[dict]:
    """One row per section: section, commit, dirty, ancestor, changed (changed_since), processor, gpu, mode,
    seconds, date."""
    doc = read(COMMITTED) if doc is None else doc
    rows = []
    for name, section in doc["sections"].items():
        p = section["provenance"]
        commit, dirty = p.get("git", {}).get("commit", "unknown"), p.get("git", {}).get("dirty")
        known = commit != "unknown"
        rows.append({"section": name, "commit": commit, "dirty": dirty,
                     "ancestor": is_ancestor(commit) if known else None,
                     "changed": changed_since(commit, name) if known else None,
                     "processor": p.get("machine", {}).get("processor"), "gpu": p.get("gpu"),
                     "mode": p.get("mode"), "seconds": p.get("wall_seconds"), "date": p.get("date", "")[:16],
                     "work_in_progress": bool(p.get("work_in_progress"))})
    return rows


def problems(doc=None) -> list[str]:
    """What a committed results file must not hold: sections from dirty trees, unknown commits or commits
    that are not ancestors of HEAD, and work in progress."""
    out = []
    for r in status(doc):
        if r["dirty"] is not False or r["work_in_progress"]:
            out.append(f"{r['section']}: measured on a working tree with uncommitted changes (commit {r['commit']})")
        if r["ancestor"] is not True:
            out.append(f"{r['section']}: commit {r['commit']} is not an ancestor of HEAD")
    return out


def main() -> int:
    rows = status()
    word = {True: "yes", False: "no", None: "?", "docs": "docs only"}
    print(f"{'section':10} {'commit':8} {'clean':5} {'changed since':13} {'mode':5} {'seconds':>8}  machine")
    for r in rows:
        machine = r["processor"] + (f" + {r['gpu']}" if r["gpu"] else "")
        seconds = f"{r['seconds']:,.0f}" if r["seconds"] is not None else "?"
        print(f"{r['section']:10} {r['commit']:8} {word[r['dirty'] is False]:5} {word[r['changed']]:13} "
              f"{r['mode']:5} {seconds:>8}  {machine}")
    machines = {r["processor"] for r in rows if not r["gpu"]}
    print(f"\n{len(rows)} sections; CPU sections from {len(machines)} processor(s): {', '.join(sorted(machines))}")
    for p in problems():
        print(f"problem: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
