"""`make lab`: a double-click opens a chapter as a notebook, and a chapter only opened, run and saved stays the
committed file (lab/jupyter.py, notebooks/jupytext.toml).

Oracle for the save: the committed bytes. JupyterLab saves through jupytext's contents manager, the one
`make lab` starts; the fast test below sends it what JupyterLab sends after a run (the running kernel's
kernelspec, language_info, widget state, outputs, execution counts, timing and view metadata) and the file
must come back byte for byte. The slow test does it for real: JupyterLab in headless Chromium (`make lab-check`).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab import jupyter

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("ch*.py"))


def test_there_are_chapters_and_the_config_beside_them():
    assert len(CHAPTERS) >= 8
    assert (ROOT / "notebooks" / "jupytext.toml").is_file()


def test_make_lab_runs_jupyterlab_on_the_chapters_through_jupytexts_contents_manager():
    argv = jupyter.command("--port=9999")
    assert argv[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={ROOT / 'notebooks'}" in argv
    assert "--ServerApp.contents_manager_class=jupytext.TextFileContentsManager" in argv
    assert argv[-1] == "--port=9999" and "--no-browser" not in argv
    make = (ROOT / "Makefile").read_text()
    assert "-m lab.jupyter" in make and "-m lab.jupyter --check" in make     # make lab, make lab-check


def test_the_default_viewer_is_written_into_the_given_settings_file_once(tmp_path):
    pytest.importorskip("jupytext_config")
    path = tmp_path / "settings" / "overrides.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    assert jupyter.set_default_viewer(path) == path
    first = path.read_text()
    jupyter.set_default_viewer(path)
    assert path.read_text() == first                                             # idempotent
    assert jupyter.default_viewers(path) == {"python": jupyter.VIEWER}
    assert json.loads(first)["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}


def test_the_overrides_file_is_the_one_this_environments_jupyterlab_reads():
    commands = pytest.importorskip("jupyterlab.commands", reason="the [lab] extra (make lab) is not installed")
    assert jupyter.overrides_path() == Path(commands.get_app_dir()) / "settings" / "overrides.json"
    assert Path(sys.prefix) in jupyter.overrides_path().parents                 # the environment, not $HOME


def _jupyterlab_after_a_run(nb, kernelspec):
    """What JupyterLab sends back after every code cell ran and a few were collapsed: notebook metadata
    from the running kernel and the widget manager, outputs, counts, timing and view metadata."""
    nb.metadata["kernelspec"] = kernelspec
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python",
                                    "file_extension": ".py", "codemirror_mode": {"name": "ipython", "version": 3}}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}}
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        cell.outputs = [{"output_type": "stream", "name": "stdout", "text": f"output {count}\n"}]
        cell.metadata["execution"] = {"iopub.execute_input": "2026-12-01T10:00:00Z",
                                      "shell.execute_reply": "2026-12-01T10:00:01Z"}
        if count % 3 == 0:
            cell.metadata["collapsed"] = True
            cell.metadata["jupyter"] = {"outputs_hidden": True, "source_hidden": count % 2 == 0}
            cell.metadata["scrolled"] = True
    return nb


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_run_and_saved_in_jupyterlab_is_byte_for_byte_the_committed_file(chapter, tmp_path):
    pytest.importorskip("jupyter_server", reason="the [lab] extra (make lab) is not installed")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupytext import TextFileContentsManager

    shutil.copy(chapter, tmp_path / chapter.name)
    shutil.copy(ROOT / "notebooks" / "jupytext.toml", tmp_path / "jupytext.toml")
    spec = KernelSpecManager().get_kernel_spec("python3")                      # the kernel `make lab` runs
    kernelspec = {"display_name": spec.display_name, "language": spec.language, "name": "python3"}

    cm = TextFileContentsManager(root_dir=str(tmp_path))
    model = cm.get(chapter.name)
    assert model["type"] == "notebook" and model["content"].metadata["kernelspec"] == kernelspec, (
        f"{chapter.name}'s header names another kernel than `make lab` runs ({kernelspec}): "
        "JupyterLab would rewrite it on the first save")
    _jupyterlab_after_a_run(model["content"], kernelspec)
    cm.save(model, chapter.name)
    saved = (tmp_path / chapter.name).read_text()
    assert saved == chapter.read_text(), f"saving {chapter.name} in JupyterLab changes it (a dirty checkout)"


def test_a_readers_edit_is_saved(tmp_path):
    """The filters keep a run from changing the file, not a reader's edit: a changed cell is written."""
    pytest.importorskip("jupyter_server", reason="the [lab] extra (make lab) is not installed")
    from jupytext import TextFileContentsManager

    chapter = CHAPTERS[0]
    shutil.copy(chapter, tmp_path / chapter.name)
    shutil.copy(ROOT / "notebooks" / "jupytext.toml", tmp_path / "jupytext.toml")
    cm = TextFileContentsManager(root_dir=str(tmp_path))
    model = cm.get(chapter.name)
    code = next(c for c in model["content"].cells if c.cell_type == "code")
    code.source += "\nprint('my note')"
    code.metadata["tags"] = ["mine"]
    cm.save(model, chapter.name)
    saved = (tmp_path / chapter.name).read_text()
    assert "print('my note')" in saved and 'tags=["mine"]' in saved


# Slow: JupyterLab and headless Chromium start, the chapter's first cell imports torch and transformers
# (12-30 s here). `make test-slow` runs it; it skips where JupyterLab is not installed (the [lab] extra) or no
# Chromium can be found or installed (lab.book.screens.chromium installs Debian's package when run as root).
@pytest.mark.slow
def test_a_double_click_in_jupyterlab_opens_a_chapter_as_a_notebook_that_runs_and_saves_clean():
    pytest.importorskip("jupyterlab", reason="the [lab] extra (make lab) is not installed")
    pytest.importorskip("websocket", reason="the [lab] extra (make lab) is not installed")
    from lab.book.render import BookError
    from lab.book.screens import chromium

    try:
        chromium()
    except (BookError, subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"no headless Chromium here: {e}")
    seen = jupyter.check("ch01_recompute.py")                 # screenshots in build/lab-check/
    assert seen["view"]["notebook"] and seen["view"]["file_editors"] == 0
    assert seen["view"]["code_cells"] > 5 and seen["view"]["markdown_cells"] > 5
    assert seen["prompt"] == "[1]:"
    assert "torch 2.13" in seen["output"] and "quick mode" in seen["output"]
    assert seen["saved"] and seen["unchanged"]
