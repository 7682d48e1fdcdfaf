"""A reader's edits in `make lab`: the answers live in the reader's copy under notebooks/mine/, the chapters stay
as git has them, and `git pull` brings a new edition without a conflict and without losing an answer
(lab/jupyter.py, ChapterContentsManager). And what a reader sees while running a chapter: the line an exercise
not attempted yet prints, and the progress bars a chapter's output keeps.

Oracle for the update: git itself. An upstream repository holds a chapter; the reader's clone is served by the
contents manager `make lab` starts, the reader writes an answer and saves it as JupyterLab would (Ctrl+S on the
chapter, then File > Save Notebook As… mine/<chapter>); upstream changes the chapter and the reader runs
`git pull`, which must succeed, leave `git status` empty and the answer in the copy. JupyterLab's own side (its
autosave passes a file by when the server calls it not writable; Ctrl+S says "read-only") is driven in a real
browser by the slow test of tests/test_jupyterlab.py.
"""

import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lab import jupyter

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "notebooks" / "ch01_recompute.py"
ANSWER = "print('my answer')  # the reader's"

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(cwd, *args) -> str:
    done = subprocess.run(["git", "-c", "user.name=reader", "-c", "user.email=reader@example.invalid",
                           "-c", "init.defaultBranch=main", "-c", "advice.detachedHead=false", *args],
                          cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"git {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def manager(root):
    pytest.importorskip("jupyter_server", reason="the [lab] extra (make lab) is not installed")
    return jupyter.ChapterContentsManager(root_dir=str(root))


@pytest.fixture
def book(tmp_path):
    """(upstream, reader): a repository with the book's notebooks/ and .gitignore, and a reader's clone."""
    upstream = tmp_path / "upstream"
    (upstream / "notebooks").mkdir(parents=True)
    shutil.copy(CHAPTER, upstream / "notebooks" / CHAPTER.name)
    shutil.copy(ROOT / "notebooks" / "jupytext.toml", upstream / "notebooks" / "jupytext.toml")
    shutil.copy(ROOT / ".gitignore", upstream / ".gitignore")
    git(upstream, "init", "-q")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-q", "-m", "first edition")
    git(tmp_path, "clone", "-q", str(upstream), "reader")
    return upstream, tmp_path / "reader"


def with_answer(model):
    """The notebook of `model` with ANSWER typed at the end of its first code cell."""
    code = next(c for c in model["content"].cells if c.cell_type == "code")
    code.source += "\n" + ANSWER
    return model


@needs_git
def test_a_readers_answers_survive_a_git_pull_of_the_next_edition(book):
    from tornado.web import HTTPError

    upstream, reader = book
    notebooks, name = reader / "notebooks", CHAPTER.name
    committed = (notebooks / name).read_bytes()
    cm = manager(notebooks)

    model = cm.get(name)
    assert model["type"] == "notebook"
    # not writable: JupyterLab's autosave passes the chapter by (its context's canSave is the model's
    # `writable`), and Ctrl+S says "read-only, use Save as…"
    assert model["writable"] is False
    with_answer(model)
    with pytest.raises(HTTPError) as refused:                   # a client that saves anyway
        cm.save(model, name)
    assert refused.value.status_code == 403 and f"{jupyter.MINE}/" in refused.value.log_message
    assert (notebooks / name).read_bytes() == committed

    # File > Save Notebook As… mine/<chapter>: the folder is made by the first save there
    assert not (notebooks / jupyter.MINE).exists()
    cm.save(model, f"{jupyter.MINE}/{name}")
    copy = notebooks / jupyter.MINE / name
    assert ANSWER in copy.read_text()
    assert cm.get(f"{jupyter.MINE}/{name}", content=False)["writable"] is True   # the copy autosaves
    assert git(reader, "status", "--porcelain", "--untracked-files=all") == ""  # mine/ is ignored

    # the next edition, upstream: a changed line and a new cell in the same chapter
    text = (upstream / "notebooks" / name).read_text()
    first = next(line for line in text.splitlines() if line.startswith("# # Chapter 1"))
    edition = text.replace(first, first + " (second edition)") + "\n# %%\nprint('new in the second edition')\n"
    (upstream / "notebooks" / name).write_text(edition)
    git(upstream, "commit", "-q", "-am", "second edition")

    git(reader, "pull", "-q", "--ff-only")
    assert (notebooks / name).read_text() == edition               # the reader has the new edition
    assert git(reader, "status", "--porcelain", "--untracked-files=all") == ""
    assert ANSWER in copy.read_text()                              # and the answer
    reopened = cm.get(f"{jupyter.MINE}/{name}")
    assert any(ANSWER in c.source for c in reopened["content"].cells)
    assert "new in the second edition" in cm.get(name)["content"].cells[-1].source


@needs_git
def test_the_book_files_cannot_be_renamed_or_deleted_from_jupyterlab(book):
    from tornado.web import HTTPError

    _, reader = book
    cm = manager(reader / "notebooks")
    for do in (lambda: cm.rename_file(CHAPTER.name, "renamed.py"), lambda: cm.delete_file(CHAPTER.name),
               lambda: cm.save({"type": "file", "format": "text", "content": "x = 1\n"}, "jupytext.toml")):
        with pytest.raises(HTTPError) as refused:
            do()
        assert refused.value.status_code == 403
    assert git(reader, "status", "--porcelain", "--untracked-files=all") == ""
    # the reader's own files are the reader's: a new one is saved, renamed and deleted as usual
    cm.save({"type": "file", "format": "text", "content": "notes\n"}, "mine/notes.txt")
    cm.rename_file("mine/notes.txt", "mine/notes.md")
    cm.delete_file("mine/notes.md")
    assert not (reader / "notebooks" / "mine" / "notes.md").exists()


@needs_git
def test_the_book_files_are_the_files_git_tracks(book, tmp_path):
    _, reader = book
    (reader / "notebooks" / "untracked.py").write_text("# %%\n")
    assert jupyter.book_files(reader / "notebooks") == {CHAPTER.name, "jupytext.toml"}
    # outside a git checkout (a tarball of the book): the chapters and jupytext.toml at the top
    plain = tmp_path / "plain"
    shutil.copytree(reader / "notebooks", plain)
    (plain / "mine").mkdir()
    (plain / "mine" / CHAPTER.name).write_text("# %%\n")
    assert jupyter.book_files(plain) == {CHAPTER.name, "jupytext.toml"}


def test_mine_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", f"notebooks/{jupyter.MINE}/{CHAPTER.name}"], cwd=ROOT)
    assert done.returncode == 0, f"notebooks/{jupyter.MINE}/ is not in .gitignore: a reader's copy would be untracked"


# ---- an exercise not attempted yet ----------------------------------------------------------------------------

# What each chapter prints for an exercise whose stub still raises NotImplementedError: "check_x: not attempted
# yet", the name and the colon together. Chapters whose notebook is edited elsewhere at the moment carry the old
# line until their owners change it: expected to fail there, not strictly (they pass once fixed).
PRINTS = re.compile(r"^\s*print\(.*not attempted.*\)\s*$", re.M)


def printed(line: str, name="check_x") -> str:
    """What `line`, one print() call of an exercise cell, writes when the check is called `name`."""
    import contextlib
    import io

    out = io.StringIO()
    check = type("Check", (), {"__name__": name})()
    with contextlib.redirect_stdout(out):
        eval(line.strip(), {"check": check, "context": 4096})          # the book's own line
    return out.getvalue()


def test_printed_reads_a_print_call_as_python_prints_it():
    assert printed('print(check.__name__, ": not attempted yet")') == "check_x : not attempted yet\n"
    assert printed('print(f"{check.__name__}: not attempted yet")') == "check_x: not attempted yet\n"


@pytest.mark.parametrize("chapter", sorted((ROOT / "notebooks").glob("ch*.py")), ids=lambda p: p.stem)
def test_an_exercise_not_attempted_prints_its_name_and_a_colon_without_a_space(chapter):
    lines = PRINTS.findall(chapter.read_text())
    for line in lines:
        text = printed(line)
        assert "not attempted" in text
        assert not re.search(r"\s:", text), f"{chapter.name} prints {text!r}"


# ---- progress bars ------------------------------------------------------------------------------------------------

# What a chapter's output keeps of its progress bars: a long loop shows one tqdm.auto bar that says what it counts
# (desc), and a bar made once per pass of an outer loop goes when it finishes (leave=False), so that a measuring
# cell keeps one finished bar per loop rather than one per workload, case or pool size. A bar is a widget in
# JupyterLab and under nbclient: a finished bar with leave=False is closed, and nothing of it stays.
BARS = sorted({*(ROOT / "lab").glob("*.py"), *(ROOT / "lab" / "experiments").glob("*.py"),
               *(ROOT / "lab" / "peers").glob("*.py")})


def tqdm_calls(path):
    """(line, in_loop, leave, desc) of every tqdm(...) call in `path`; in_loop: the call is made again on every
    pass of an enclosing for loop or comprehension of the same function (not as the loop's own iterable)."""
    import ast

    tree = ast.parse(path.read_text())
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    comps = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    out = []
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None)) == "tqdm"):
            continue
        kw = {k.arg: k.value for k in call.keywords}
        in_loop, child, node = False, call, parent.get(call)
        while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and child is not getattr(node, "iter", None):
                in_loop = True
            if isinstance(node, ast.comprehension):
                comp = parent[node]                   # only the first generator's iterable is evaluated once
                in_loop |= child is not node.iter or node is not comp.generators[0]
                child, node = comp, parent.get(comp)
                continue
            if isinstance(node, comps) and child is not node.generators[0]:
                in_loop = True
            child, node = node, parent.get(node)
        leave = kw.get("leave")
        out.append((call.lineno, in_loop, None if leave is None else ast.literal_eval(leave), "desc" in kw))
    return out


def test_tqdm_calls_reads_loops_as_python_runs_them(tmp_path):
    src = tmp_path / "bars.py"
    src.write_text("def f(xs, ys):\n"
                   "    for x in tqdm(xs, desc='a'):\n"                           # 2: the loop's own bar
                   "        [g(y) for y in tqdm(ys, desc='b')]\n"                  # 3: made on every pass of x
                   "    return {k: [h(y) for y in tqdm(ys, desc='c', leave=False)] for k in tqdm(xs)}\n")  # 4
    assert sorted(tqdm_calls(src)) == [(2, False, None, True), (3, True, None, True), (4, False, None, False),
                                       (4, True, False, True)]


@pytest.mark.parametrize("path", [p for p in BARS if "tqdm" in p.read_text()], ids=lambda p: str(p.relative_to(ROOT)))
def test_a_bar_says_what_it_counts_and_a_bar_made_in_a_loop_does_not_stay(path):
    for line, in_loop, leave, desc in tqdm_calls(path):
        where = f"{path.relative_to(ROOT)}:{line}"
        assert desc, f"{where}: a bar without a desc"
        assert not in_loop or leave is False, f"{where}: a bar made on every pass of a loop stays (leave=False)"


class Bars:
    """tqdm.auto's stand-in for a module under test: a plain tqdm writing nowhere, every bar it made kept."""

    def __init__(self):
        from tqdm import std

        made = self.made = []

        class Bar(std.tqdm):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs, file=io.StringIO(), mininterval=0)
                made.append(self)

        self.tqdm = Bar

    def kept(self):
        """The bars a notebook's output would keep: leave=True (tqdm's default)."""
        return [b for b in self.made if b.leave]


def test_ch09_engine_runs_shows_one_bar_over_every_run(smollm2, monkeypatch):
    """Regression: the engine cell of chapter 9 ran about a minute in quick mode with no bar."""
    from lab.experiments import ch09_speculation as ch09

    bars = Bars()
    monkeypatch.setattr(ch09, "tqdm", bars.tqdm)
    s = dict(engine_levels=(1,), engine_prompt=16, engine_new=2)
    out = ch09.engine_runs(smollm2, s)
    assert set(out) == {1}
    kept = bars.kept()
    assert len(bars.made) == 1 and len(kept) == 1 and kept[0].desc.startswith("engine")
    assert kept[0].n == kept[0].total == 2 * len(s["engine_levels"])             # plain and lookup at each level


def test_ch11_tier_sweep_keeps_one_bar_not_one_per_workload_and_case(smollm2, monkeypatch):
    """Regression: chapter 11's notebook kept a finished bar for every workload and tier case (12 in the
    tiers cell, 16 in the radix cell, 6 in the routers cell)."""
    import random

    from lab.experiments import ch11_beyond as ch11

    bars = Bars()
    monkeypatch.setattr(ch11, "tqdm", bars.tqdm)
    rng = random.Random(0)
    head = [rng.randrange(300) for _ in range(40)]
    loads = {name: [head + [rng.randrange(300) for _ in range(8)] for _ in range(6)] for name in ("a", "b")}
    ch11.tier_sweep(smollm2, loads, fractions=(0.5, 1.0), host_factor=2)
    ch11.radix_sweep(smollm2, loads, fractions=(0.5, 1.0), page_sizes=(1, 16))
    ch11.routers_simulated(dict(sim_requests=30, sim_apps=2, sim_workers=(2, 4), sim_pages=512))
    kept = bars.kept()
    assert [b.desc.split(":")[0] for b in kept] == ["tiers", "radix against hash chains", "routers, simulated"]
    assert [b.n for b in kept] == [2, 2, len(ch11.POLICIES)]                     # every workload, every policy
    assert len(bars.made) > len(kept)                                           # the inner ones were there
