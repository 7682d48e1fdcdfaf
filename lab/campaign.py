"""`python -m lab.campaign` (`make results-status`): where every section of results/results.json stands.

For each section: the commit that measured it, whether its working tree was clean, whether the code the
section runs (`sources`: the lab modules its experiment imports or starts, read from the code) has changed
since that commit, the machine, the mode and the wall time. A change that leaves the syntax tree of every
changed Python file the same once docstrings are set aside (comments never reach it) reads "docs only": the
code that ran is the code there is now. Within a module only the definitions the section can reach count
(`reached`): a change to `loadgen.compare_servers` is not a change to a section that imports only
`loadgen.random_prompts`. `problems(doc)` names what a committed results file must not hold: a
section measured on a dirty tree, or at a commit that is not an ancestor of HEAD (tests/test_results.py holds
the file to it).
"""

import ast
import functools
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


def closure(path: Path, programs: set | None = None) -> set[Path]:
    """The files of lab a module runs: its own, the lab modules it imports, those it starts by name (`-m
    lab.x`) or as a script beside it, their packages' __init__.py, and so on. Read from the code, not run.
    `programs`, where given, receives the files that run as programs: `path`, the modules started by name and
    the scripts."""
    seen, todo = set(), [path]
    programs = set() if programs is None else programs
    programs.add(path)
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            files, started = _runs(f)
            todo += files
            programs.update(started)
    return seen


@functools.cache
def _runs(f: Path) -> tuple[list[Path], list[Path]]:
    """The files of lab that file f runs (`closure`, one step), and those of them that run as programs."""
    package = list(f.relative_to(REPO_ROOT).parts[:-1])          # lab/x/y.py and lab/x/__init__.py: lab.x
    names = [".".join(package[:i]) for i in range(1, len(package) + 1)]  # the packages above it run too
    files, started = [], []
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
                started += [m for m in (_file(node.value), _file(f"{node.value}.__main__")) if m]
            elif SCRIPT.fullmatch(node.value) and (f.parent / node.value).is_file():
                files.append(f.parent / node.value)
                started.append(f.parent / node.value)
    files += [m for m in map(_file, (n for n in names if n == "lab" or n.startswith("lab."))) if m]
    return files, started


ALL = "*"                               # every definition of a module (reached): it runs as a whole


def definitions(text: str) -> dict[str, str]:
    """A Python file's top-level definitions, {name: its code}: functions, classes and names assigned, their
    docstrings set aside; "" holds the rest (imports and other statements: they run whenever the module is
    imported)."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue                                  # the module's docstring, or another string that does nothing
        for name in _names(node):
            out[name] = out.get(name, "") + _code(node)
    return out


def _names(node) -> list[str]:
    """The names a top-level statement defines, [""] for any other statement."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign) and all(isinstance(x, ast.Name) for x in node.targets):
        return [x.id for x in node.targets]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return [""]


def _code(node) -> str:
    """The syntax tree of `node` as text, every docstring in it set aside."""
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            n.body = body[1:] or [ast.Pass()]
    return ast.dump(node)


def _module(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def reached(files: set[Path], whole: set[Path]) -> dict[Path, set[str]]:
    """{file: the names of its top-level definitions that the code of `files` can reach}, {ALL} for the
    files of `whole` (run as programs) and for a module used as a value or imported with *. A name is
    reached when another file imports it (`from m import f`) or names it on the module (`m.f`, `import m`),
    when the module's own statements name it or it is decorated (a decorator may register it), or when a
    reached definition of the same file names it. Every line of the other files counts, reached or not:
    this can say too much, not too little, short of a name looked up as a string (getattr(m, "f"))."""
    by_module = {_module(f): f for f in files}
    used = {f: ({ALL} if f in whole else set()) for f in files}
    for f in files:
        for module, name in _uses(f)[0]:
            if module in by_module:
                used[by_module[module]].add(name)
    for f in files:                                   # within a file: what its statements and reached names name
        inside, todo = _uses(f)[1], list(used[f] | {""})
        while todo:
            for n in inside.get(todo.pop(), ()):
                if n not in used[f]:
                    used[f].add(n)
                    todo.append(n)
    return used


@functools.cache
def _uses(f: Path) -> tuple[list, dict]:
    """What file f names of lab's modules, [(module, name or ALL)], and {its top-level name: the top-level
    names of f that its statement names} ("" for the other statements, with the decorated definitions)."""
    tree, package = ast.parse(f.read_text()), _module(f).split(".")
    if f.name != "__init__.py":
        package = package[:-1]
    uses, aliases, roots = [], {}, set()              # local name: module; Name nodes that start a.b.c
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(base + (node.module.split(".") if node.module else []))
            for a in node.names:
                if _file(f"{base}.{a.name}"):
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                else:
                    uses.append((base, ALL if a.name == "*" else a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                roots.add(id(value))
                dotted = [*aliases[value.id].split("."), *chain]
                i = next((i for i in range(len(dotted) - 1, 0, -1) if _file(".".join(dotted[:i]))), None)
                if i:                                 # the longest prefix that is a module of lab's
                    uses.append((".".join(dotted[:i]), dotted[i]))
    uses += [(aliases[n.id], ALL) for n in ast.walk(tree)   # a module itself passed around: all of it
             if isinstance(n, ast.Name) and n.id in aliases and id(n) not in roots]
    tops, inside = {name for node in tree.body for name in _names(node)}, {}
    for node in tree.body:
        named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in tops}
        for name in _names(node):
            inside.setdefault(name, set()).update(named)
            if getattr(node, "decorator_list", None):     # a decorator may register it: run by key, not name
                inside.setdefault("", set()).add(name)
    return uses, inside


def sources(section: str) -> list[str]:
    """The git pathspecs of the code section `section` runs: its experiment module's `closure` and the results
    schema; for "notebooks", all of lab but the book tooling, the exercises and the other experiments, and
    the notebooks (a notebook imports what it likes)."""
    if section == "notebooks":
        return SHARED + ["lab/experiments/notebooks.py", "lab/results.schema.json", "notebooks"]
    files = closure(_entry(section))
    return sorted(str(f.relative_to(REPO_ROOT)) for f in files) + ["lab/results.schema.json"]


def _entry(section: str) -> Path:
    name = section.removesuffix("_gpu")
    module = "gpu" if section.endswith("_gpu") else CHAPTERS.get(name, name)
    return REPO_ROOT / "lab" / "experiments" / f"{module}.py"


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)


def is_ancestor(commit: str) -> bool | None:
    """Whether `commit` is HEAD or an ancestor of it; None when git cannot say (no repository, no commit)."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return False if _git("rev-parse", "HEAD").returncode == 0 else None
    return _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0


def same_code(old: str | None, new: str | None) -> bool:
    """Whether two versions of a Python file differ only in docstrings and comments (None: no such file)."""
    if old is None or new is None:
        return old is new
    try:
        return _code(ast.parse(old)) == _code(ast.parse(new))
    except SyntaxError:
        return False


def changed_since(commit: str, section: str) -> bool | str | None:
    """Whether the code `section` runs differs between `commit` and HEAD: True; "docs" when every changed file
    is Python whose `definitions` are the same (`same_code`) or whose changed definitions the section does not reach
    (`reached`), one at least in its docstrings; False when nothing it reaches changed (None: git cannot say)."""
    r = _git("diff", "--name-only", commit, "HEAD", "--", *sources(section))
    if r.returncode:
        return None
    files, docs = r.stdout.split(), False
    if not files:
        return False
    use = {}
    if section != "notebooks":                       # a notebook imports what it likes: all of lab counts
        programs = set()
        use = reached(closure(_entry(section), programs), programs)

    def show(rev, path):
        out = _git("show", f"{rev}:{path}")
        return out.stdout if out.returncode == 0 else None
    for f in files:
        old, new = show(commit, f), show("HEAD", f)
        if not f.endswith(".py") or old is None or new is None:
            return True
        try:
            a, b = definitions(old), definitions(new)
        except SyntaxError:
            return True
        changed = {name for name in a.keys() | b.keys() if a.get(name) != b.get(name)}
        reach = use.get(REPO_ROOT / f, {ALL})
        if changed and (ALL in reach or changed & (reach | {""})):
            return True
        docs = docs or not changed                   # the same definitions: docstrings or comments only
    return "docs" if docs else False


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
