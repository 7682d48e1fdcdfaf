"""`python -m lab.experiments.notebooks [ch01 ...]`: how long each chapter notebook takes a reader, in quick mode.

Every notebooks/chNN_*.py (jupytext percent format) is converted to a notebook and executed top to bottom
in a fresh kernel, as a reader runs it: in quick mode (LAB_QUICK=1) and with LAB_RESULTS pointing at a
temporary file, so the run never touches the committed results. The wall time of each, kernel start
included, goes into the section "notebooks" of the results file in use (results/results.json under
`make results`), next to the limit a chapter must stay under (LIMIT_S) and whether it does:

    notebooks.limit                     300 s
    notebooks.seconds.ch01_recompute    the wall time, s
    notebooks.within_limit.ch01_recompute   true when seconds <= limit
    notebooks.all_within_limit

A notebook that fails is recorded as not run, with the error, and the command exits with status 1. Running
some notebooks (`python -m lab.experiments.notebooks ch02`) replaces their times and keeps the others'.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from ..results import REPO_ROOT, not_run, provenance, quick, read, require_clean, results_path, value, write_section

LIMIT_S = 300  # a chapter notebook must run in quick mode in under five minutes on two cores
CELL_TIMEOUT_S = 1800  # a cell stuck this long is stopped; the limit itself is only recorded, not enforced
SECTION = "notebooks"


def execute(source: Path, workdir: Path, env: dict, timeout=CELL_TIMEOUT_S) -> float:
    """Convert a jupytext notebook, run it in a fresh python3 kernel with env, in workdir; its wall time in s.

    Raises nbclient.exceptions.CellExecutionError (with the cell and traceback) when a cell fails.
    """
    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(source)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    t0 = time.perf_counter()  # one wall time per notebook, read once: lab.bench's repetitions would not fit
    client.execute(env=env)  # the kernel starts in resources' metadata.path
    return time.perf_counter() - t0


def quick_env(results_file: Path) -> dict:
    """The environment of a kernel that runs a notebook as a reader does: quick mode, a temporary results file."""
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_FULL", "LAB_QUICK", "LAB_RESULTS")}
    return {**env, "LAB_QUICK": "1", "LAB_RESULTS": str(results_file),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))}


def time_notebooks(sources, path=None, limit=LIMIT_S) -> dict:
    """Run every notebook in sources (paths to .py files); write the section "notebooks" of the results file
    at path (default: the one in use) and return its values."""
    seconds, within = {}, {}
    with tempfile.TemporaryDirectory(prefix="lab-notebooks-") as tmp:
        env = quick_env(Path(tmp) / "results.json")
        for source in map(Path, sources):
            name = source.stem
            print(f"== {name}: running in quick mode ...", flush=True)
            try:
                t = execute(source, source.parent, env)
            except Exception as e:  # a failing cell, a kernel that died: recorded, and the run fails
                reason = f"the notebook failed: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
                print(f"== {name}: {reason}", flush=True)
                seconds[name], within[name] = not_run(reason, "s"), not_run(reason)
                continue
            seconds[name] = value(round(t, 1), "s", note="wall time of a fresh kernel running every cell, quick mode")
            within[name] = value(t <= limit, None)
            print(f"== {name}: {t:.0f} s ({'within' if t <= limit else 'OVER'} the {limit} s limit)", flush=True)
    # a run of some notebooks keeps the times of the others already in the file
    earlier = read(path).get("sections", {}).get(SECTION, {}).get("values", {})
    seconds = {**earlier.get("seconds", {}), **seconds}
    within = {**earlier.get("within_limit", {}), **within}
    values = {
        "limit": value(limit, "s", note="a chapter notebook runs in quick mode in under five minutes"),
        "seconds": seconds,
        "within_limit": within,
        "all_within_limit": value(all(v["value"] is True for v in within.values()), None),
    }
    write_section(SECTION, values, provenance(notebook_mode="quick"), path=path)
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.notebooks", description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="e.g. ch01 ch03 (default: every notebook)")
    parser.add_argument("--notebooks", type=Path, default=REPO_ROOT / "notebooks", help="notebooks folder")
    args = parser.parse_args(argv)
    require_clean()
    sources = sorted(args.notebooks.glob("ch*.py"))
    if args.chapters:
        sources = [s for s in sources if s.stem.split("_")[0] in args.chapters]
    if not sources:
        print(f"no notebooks to run in {args.notebooks}", file=sys.stderr)
        return 1
    print(f"== notebooks ({'quick' if quick() else 'full'} run; the notebooks run in quick mode) -> {results_path()}")
    values = time_notebooks(sources)
    return 0 if all(v["value"] != "NOT_RUN" for v in values["seconds"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
