"""`python -m lab.campaign` (`make results-status`): where every section of results/results.json stands.

For each section: the commit that measured it, whether its working tree was clean, whether the code the
section runs has changed since that commit (lab/ but the book tooling, the exercises and the other
experiments; its own experiment module; the notebooks for section "notebooks"), the machine, the mode and
the wall time. `problems(doc)` names what a committed results file must not hold: a section measured on a
dirty tree, or at a commit that is not an ancestor of HEAD (tests/test_results.py holds the file to it).
"""

import subprocess
import sys

from .experiments import CHAPTERS
from .results import COMMITTED, REPO_ROOT, read

SHARED = ["lab", ":(exclude)lab/book", ":(exclude)lab/exercises", ":(exclude)lab/experiments",
          "lab/experiments/__init__.py", "lab/experiments/plots.py", "lab/experiments/tables.py"]


def sources(section: str) -> list[str]:
    """The git pathspecs of the code section `section` runs: SHARED and its experiment module."""
    name = section.removesuffix("_gpu")
    module = "gpu" if section.endswith("_gpu") else CHAPTERS.get(name, name)
    return SHARED + [f"lab/experiments/{module}.py"] + (["notebooks"] if section == "notebooks" else [])


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)


def is_ancestor(commit: str) -> bool | None:
    """Whether `commit` is HEAD or an ancestor of it; None when git cannot say (no repository, no commit)."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return False if _git("rev-parse", "HEAD").returncode == 0 else None
    return _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0


def changed_since(commit: str, section: str) -> bool | None:
    """Whether the code `section` runs differs between `commit` and HEAD (None: git cannot say)."""
    r = _git("diff", "--quiet", commit, "HEAD", "--", *sources(section))
    return {0: False, 1: True}.get(r.returncode)


def status(doc=None) -> list[dict]:
    """One row per section: section, commit, dirty, ancestor, changed, processor, gpu, mode, seconds, date."""
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
    word = {True: "yes", False: "no", None: "?"}
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
