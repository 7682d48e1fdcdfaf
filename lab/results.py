"""
Reading and writing results/results.json, the single source of every measured number.

The file holds one section per chapter. A section is what one run of a chapter's experiment measured:

    {"schema_version": 1,
     "sections": {
       "ch01": {"provenance": {...where, when and with what it ran...},
                "values": {"positions": {"uncached": {"value": 1040, "unit": "positions"}}},
                "figures": {"speedup": {"path": "results/figures/speedup.png", "caption": "..."}}}}}

Every leaf of "values" is a dict made by value() or not_run(). The manuscript quotes a leaf by its dotted
key, here "ch01.positions.uncached".

Writes merge by section (a chapter's run replaces its own section and leaves the others alone), are
validated against lab/results.schema.json before anything touches the disk, and are atomic: the new
document goes to a temporary file in the same folder, is flushed to disk, then renamed over the old one.
A lock file serialises concurrent writers so that none loses another's section. A corrupt file is never
overwritten: reading it, or writing a section into it, raises ResultsError saying how to recover.

Two modes. Quick mode is the default (a notebook opened by hand, `make lab`, `make test`): shorter sweeps,
fewer trials, and a temporary results file, so running a chapter never touches the committed results. Full
mode is chosen on purpose with LAB_FULL=1 (`make results` sets it): the full sweeps, written to
results/results.json and results/figures/. LAB_QUICK=1 forces quick mode; setting both is an error.
LAB_RESULTS=PATH overrides where results go, in either mode.

A full-mode run refuses a working tree with uncommitted changes (require_clean(), and again when it writes
to its results file), so that every committed number names the commit that measured it; LAB_ALLOW_DIRTY=1
overrides that for work in progress and marks the section `"work_in_progress": true`. Each section records
its commit, its machine and its wall time. `python -m lab.results status` (`make results-status`) lists the
sections: commit, whether the code the section runs changed since, machine, mode and duration.
"""

import contextlib
import difflib
import fcntl
import functools
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import jsonschema

from lab import threads

REPO_ROOT = Path(__file__).resolve().parent.parent
COMMITTED = REPO_ROOT / "results" / "results.json"
FIGURES = REPO_ROOT / "results" / "figures"
SCHEMA = Path(__file__).with_name("results.schema.json")
SCHEMA_VERSION = 1
NOT_RUN = "NOT_RUN"
RECOVER = "re-run `make results`, or `git checkout results/results.json`"


class ResultsError(ValueError):
    """results.json is missing something, is corrupt, or a value would not fit the schema."""


class ResultsKeyError(KeyError, ResultsError):
    """A dotted key that names no value in results.json."""

    def __str__(self):  # KeyError would print the message in quotes, escaped
        return str(self.args[0]) if self.args else ""


# -----------------------------------------------------------------------------
# where results go


def _flag(name) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def quick() -> bool:
    """True in quick mode, the default: shorter sweeps, fewer trials, a temporary results file.

    Full mode needs LAB_FULL=1 (`make results` sets it). LAB_QUICK=1 forces quick mode; LAB_FULL=1 and
    LAB_QUICK=1 together are a contradiction and raise ResultsError rather than guess.
    """
    full, forced_quick = _flag("LAB_FULL"), _flag("LAB_QUICK")
    if full and forced_quick:
        raise ResultsError("LAB_FULL=1 and LAB_QUICK=1 are both set; unset one of them "
                           "(LAB_FULL=1 measures in full and writes results/results.json)")
    return not full


def results_path() -> Path:
    """The results file: $LAB_RESULTS if set, a temporary file in quick mode (the default), else the
    committed results/results.json (full mode, LAB_FULL=1)."""
    if os.environ.get("LAB_RESULTS"):
        return Path(os.environ["LAB_RESULTS"])
    if quick():
        return Path(tempfile.gettempdir()) / "lab-quick" / "results.json"
    return COMMITTED


def figures_dir() -> Path:
    """Where experiments save their PNGs: the figures/ folder beside the results file (created).

    In full mode that is results/figures/; in quick mode it sits beside the temporary results file.
    """
    path = results_path().parent / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


# -----------------------------------------------------------------------------
# what goes in a section


def _git() -> dict:
    """The commit the code ran from, and whether the code (anything outside results/) had changes."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        # results/ is excluded: during `make results` every chapter after the first would look dirty
        dirty = bool(git("status", "--porcelain", "--", ".", ":(exclude)results"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}
    return {"commit": commit, "dirty": dirty}


def require_clean():
    """In full mode, refuse (ResultsError) a working tree with uncommitted changes outside results/, unless
    LAB_ALLOW_DIRTY=1: call it before a long measurement, so that the run fails in a second, not at its end."""
    if quick() or _flag("LAB_ALLOW_DIRTY"):
        return
    if _git()["dirty"]:
        raise ResultsError("the working tree has uncommitted changes (`git status`); full mode measures committed "
                           "code only. Commit them, or set LAB_ALLOW_DIRTY=1 to record a work-in-progress section")


_clock = time.monotonic()


def start_clock():
    """Start timing a section: provenance() records the seconds since (or since the import of this module)."""
    global _clock
    _clock = time.monotonic()


def _processor() -> str:
    """The processor's model name ("AMD EPYC 7763 64-Core Processor"), as precise as the OS tells."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def provenance(mode=None, manifest=None, **extra) -> dict:
    """Where, when and with what a section was measured: date, commit, machine, GPU, versions, model.

    manifest: the model manifest(s) the run used (a str, or a dict of name -> manifest).
    mode: "quick" or "full"; by default what quick() says. Extra keyword arguments are recorded too.
    """
    import torch  # here, not at the top: reading results must not need torch

    git = _git()
    mode = mode or ("quick" if quick() else "full")
    wip = {"work_in_progress": True} if mode == "full" and git["dirty"] and _flag("LAB_ALLOW_DIRTY") else {}
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(time.monotonic() - _clock, 1),
        "git": git,
        "machine": {
            "arch": platform.machine(),
            "processor": _processor(),
            "os": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "openmp": {k: os.environ[k] for k in threads.KEYS if k in os.environ},  # {}: OpenMP's defaults
        },
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
        },
        "manifest": manifest,
        "mode": mode,
        **wip,
        **extra,
    }


def _plain(v):
    """numpy and torch scalars or arrays -> Python numbers or lists, which JSON can hold."""
    return v.tolist() if hasattr(v, "tolist") else v


def value(v, unit, **extra) -> dict:
    """One measured value with its unit, e.g. value(24.1, "x", spread=0.3, n=7, note="median of 7")."""
    return {"value": _plain(v), "unit": unit, **{k: _plain(x) for k, x in extra.items()}}


def not_run(reason, unit=None) -> dict:
    """A value this run could not measure, and why (e.g. "needs a CUDA GPU; this machine has none")."""
    return {"value": NOT_RUN, "unit": unit, "reason": reason}


# -----------------------------------------------------------------------------
# checking, reading, writing


@functools.cache
def _validator():
    schema = json.loads(SCHEMA.read_text())
    return jsonschema.Draft202012Validator(schema)


def validate(doc, path=None):
    """Raise ResultsError unless doc fits lib/results.schema.json. path only names the file in messages."""
    error = jsonschema.exceptions.best_match(_validator().iter_errors(doc))
    if error is None:
        return
    where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
    source = f"{path} " if path else ""
    raise ResultsError(f"results document {source}does not fit the schema at {where}: {error.message}")


def _empty() -> dict:
    return {"schema_version": SCHEMA_VERSION, "sections": {}}


def read(path=None) -> dict:
    """The whole results document; an empty one when the file does not exist yet."""
    path = Path(path or results_path())
    if not path.exists():
        return _empty()
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:  # a half-written or hand-edited file
        raise ResultsError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                           f"it was left as it is. To recover, {RECOVER}.") from None
    try:
        validate(doc, path)
    except ResultsError as e:
        raise ResultsError(f"{e}; it was left as it is. To recover, {RECOVER}.") from None
    return doc


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on path + ".lock" (flock) for the duration of a read-merge-write."""
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str):
    """Write text to path so that a reader sees the old file or the new one, never a part of either."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the results file is meant to be read
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _refuse_dirty(name, provenance: dict, path):
    """A full-mode section written to the run's results file (path None) must come from committed code."""
    if path is None and provenance.get("mode") == "full" and provenance.get("git", {}).get("dirty") \
            and not provenance.get("work_in_progress"):
        raise ResultsError(f"section {name!r} was measured on a working tree with uncommitted changes; commit "
                           f"them and measure again, or set LAB_ALLOW_DIRTY=1 to record it as work in progress")


def _figure_path(p) -> str:
    """Figures inside the repository are recorded relative to its root, others as absolute paths."""
    p = Path(p).resolve()
    return p.relative_to(REPO_ROOT).as_posix() if p.is_relative_to(REPO_ROOT) else str(p)


def write_section(name, values: dict, provenance: dict, figures: dict | None = None, path=None):
    """Replace section `name` of the results file, keeping every other section as it is.

    values: nested dict whose leaves are value() / not_run() dicts.
    figures: {figure_name: {"path": png path, "caption": str}}.
    """
    _refuse_dirty(name, provenance, path)
    path = Path(path or results_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    section = {"provenance": provenance, "values": values}
    if figures:
        section["figures"] = {k: {**f, "path": _figure_path(f["path"])} for k, f in figures.items()}
    with _locked(path):
        doc = read(path)  # refuses a corrupt file rather than overwrite it
        doc["sections"][name] = section
        validate(doc, path)
        try:
            text = json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
        except ValueError as e:  # NaN or infinity: not JSON; record not_run(...) or a string instead
            raise ResultsError(f"section {name!r} for {path}: {e}") from None
        _write_atomic(path, text)


def update_section(name, key, values, provenance_extra: dict | None = None, path=None):
    """Set `key` of section `name`'s values to `values` (a leaf or a group), keeping the section's other
    values, its figures and its provenance, into which `provenance_extra` is merged: one part of a chapter
    measured again alone. ResultsError if the file has no such section yet."""
    if path is None:
        require_clean()
    path = Path(path or results_path())
    with _locked(path):
        doc = read(path)
        if name not in doc["sections"]:
            raise ResultsError(f"{path} has no section {name!r} to update: run the chapter first")
        section = doc["sections"][name]
        section["values"][key] = values
        section["provenance"] |= provenance_extra or {}
        validate(doc, path)
        try:
            text = json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
        except ValueError as e:
            raise ResultsError(f"section {name!r} for {path}: {e}") from None
        _write_atomic(path, text)


# -----------------------------------------------------------------------------
# looking values up, and writing them in prose


def _is_leaf(node) -> bool:
    return isinstance(node, dict) and "value" in node


def leaf_keys(doc) -> list[str]:
    """Every dotted key that names a value, e.g. ["ch01.positions.cached", "ch01.positions.uncached"]."""
    keys = []

    def walk(prefix, node):
        for k, child in node.items():
            if _is_leaf(child):
                keys.append(f"{prefix}.{k}")
            elif isinstance(child, dict):
                walk(f"{prefix}.{k}", child)

    for name, section in doc.get("sections", {}).items():
        walk(name, section.get("values", {}))
    return keys


def lookup(doc, key: str, source="results") -> dict:
    """The leaf at dotted `key` of an already read document; source names the file in messages."""
    section, *parts = key.split(".")
    node = doc.get("sections", {}).get(section, {}).get("values") if parts else None
    for part in parts:
        node = node.get(part) if isinstance(node, dict) and not _is_leaf(node) else None
    if _is_leaf(node):
        return node
    if isinstance(node, dict):
        raise ResultsKeyError(f"{key!r} in {source} is a group, not a value; "
                              f"its keys are: {', '.join(node) or '(none)'}")
    close = difflib.get_close_matches(key, leaf_keys(doc), n=5, cutoff=0.6)
    if close:
        hint = f"closest keys: {', '.join(close)}"
    elif doc.get("sections"):
        hint = f"sections available: {', '.join(doc['sections'])}"
    else:
        hint = "the file has no sections yet; run `make results`"
    raise ResultsKeyError(f"no value {key!r} in {source} ({hint})")


def get(key: str, path=None) -> dict:
    """The leaf dict at dotted `key`, e.g. get("ch01.positions.uncached") -> {"value": 1040, ...}."""
    path = Path(path or results_path())
    return lookup(read(path), key, source=str(path))


def _number(v) -> str:
    """ints with thousands separators; floats with 3 significant digits, scientific outside 1e-3..1e6."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    if abs(v) < 1e-3:
        return f"{v:.1e}"  # 6.0e-05
    if abs(v) >= 1e6:
        return f"{v:.2e}"  # 1.50e+09
    decimals = max(0, 2 - math.floor(math.log10(abs(v))))
    return f"{v:,.{decimals}f}"  # 24.1, 0.0123, 1,234


def format_value(leaf, spec="") -> str:
    """A leaf as it reads in prose: "1,040 positions", "24.1×", "95.2%", "not run (needs a GPU)".

    spec: a Python format spec for the number (".1f", ",d", ".3g"; "" picks 3 significant digits), then
    optionally one of
        |number      the value without its unit: format_value(v, ".1f|number") -> "46.8"
        |bool:A/B    a boolean as a word, A when true, B when false: "|bool:identical/different"
    A "|" therefore cannot be a fill character of the format spec. A boolean without |bool: reads
    "true" / "false" (lab.book.render refuses that in prose); |number and a format spec do not apply to booleans.
    """
    spec, _, how = spec.partition("|")
    spec, how = spec.strip(), how.strip()
    v, unit = leaf["value"], leaf.get("unit")
    if v == NOT_RUN:
        return f"not run ({leaf.get('reason', 'no reason recorded')})"
    values = v if isinstance(v, list) else [v]
    if how.startswith("bool:"):
        words = how[len("bool:"):].split("/")
        if len(words) != 2 or not all(w.strip() for w in words):
            raise ValueError(f"|{how}: give two words, the one for true first: |bool:identical/different")
        if not all(isinstance(x, bool) for x in values):
            raise ValueError(f"|bool: applies to a boolean, not to {v!r}")
        return ", ".join(words[0].strip() if x else words[1].strip() for x in values)
    if how not in ("", "number"):
        raise ValueError(f"unknown |{how}; after the format spec write |number or |bool:WORD_IF_TRUE/WORD_IF_FALSE")
    if any(isinstance(x, bool) for x in values) and (spec or how):
        raise ValueError(f"{v!r} is a boolean; render it with |bool:WORD_IF_TRUE/WORD_IF_FALSE")
    one = (lambda x: format(x, spec)) if spec else _number
    text = ", ".join(one(x) for x in values)
    if not unit or how == "number":
        return text
    if unit == "x":
        return f"{text}×"
    if unit == "%":
        return f"{text}%"
    if values == [1] and isinstance(v, int):  # "1 request", not "1 requests"
        unit = _singular(unit)
    return f"{text} {unit}"


def _singular(unit: str) -> str:
    """A plural word unit in the singular ("requests" -> "request", "entries" -> "entry"); abbreviations
    ("ms", "tok/s") and anything that is not a plain plural word stay as they are."""
    if not unit.isalpha() or len(unit) < 4 or not unit.endswith("s") or unit.endswith("ss"):
        return unit
    return unit[:-3] + "y" if unit.endswith("ies") else unit[:-1]
