"""`make lab`: a double-click opens a chapter as a notebook, it opens saved (not dirty), a reader's copy saved after
a run and no edit is byte for byte the chapter, and JupyterLab does not ask about its news (lab/jupyter.py,
notebooks/jupytext.toml). The chapters are read-only there: tests/test_reader_edits.py.

Oracle for the save: the committed bytes. JupyterLab saves through jupytext's contents manager, which `make lab`'s
extends; the fast test below sends it what JupyterLab sends after a run (the running kernel's kernelspec,
language_info, widget state, outputs, execution counts, timing and view metadata) and the file must come back
byte for byte. Oracle for "opens saved": a real kernel's kernel_info reply. JupyterLab marks a notebook unsaved
when its metadata changes after loading: it writes a language_info of its own when the file has none, and the
kernel's when the kernel answers; the notebook the server sends must already hold exactly what the kernel will
report. The slow test does it all for real: JupyterLab in headless Chromium (`make lab-check`).
"""

import importlib.util
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
    assert "--ServerApp.contents_manager_class=lab.jupyter.ChapterContentsManager" in argv
    if importlib.util.find_spec("jupyter_server"):               # the class the server imports by that name
        from jupytext import TextFileContentsManager

        from lab.jupyter import ChapterContentsManager
        assert issubclass(ChapterContentsManager, TextFileContentsManager)
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


def test_the_settings_turn_off_the_news_prompt_and_keep_what_is_there(tmp_path):
    pytest.importorskip("jupytext_config")
    jsonschema = pytest.importorskip("jsonschema")
    path = tmp_path / "overrides.json"
    path.write_text(json.dumps({"@jupyterlab/apputils-extension:notification": {"doNotDisturbMode": True},
                                "@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    jupyter.configure(path)
    first = path.read_text()
    jupyter.configure(path)
    assert path.read_text() == first                                             # idempotent
    doc = json.loads(first)
    notification = doc["@jupyterlab/apputils-extension:notification"]
    assert notification == {"doNotDisturbMode": True, "fetchNews": "false"}      # the reader's key kept
    assert doc["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    assert jupyter.default_viewers(path) == {"python": jupyter.VIEWER}
    # "false" is JupyterLab's "Never" in the schema it ships (the prompt asks while the value is "none")
    commands = pytest.importorskip("jupyterlab.commands", reason="the [lab] extra (make lab) is not installed")
    schema = json.loads((Path(commands.get_app_dir()) / "schemas" / "@jupyterlab" / "apputils-extension"
                         / "notification.json").read_text())
    jsonschema.validate(notification, schema)
    never = [o["const"] for o in schema["properties"]["fetchNews"]["oneOf"] if o["title"] == "Never"]
    assert never == [notification["fetchNews"]] and schema["properties"]["fetchNews"]["default"] == "none"


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
def test_a_chapter_run_and_saved_as_a_readers_copy_is_byte_for_byte_the_chapter(chapter, tmp_path):
    """File > Save Notebook As… mine/<chapter> after a run and no edit: the copy is the chapter, so a diff of
    the two shows a reader's answers and nothing else."""
    pytest.importorskip("jupyter_server", reason="the [lab] extra (make lab) is not installed")
    from jupyter_client.kernelspec import KernelSpecManager

    shutil.copy(chapter, tmp_path / chapter.name)
    shutil.copy(ROOT / "notebooks" / "jupytext.toml", tmp_path / "jupytext.toml")
    spec = KernelSpecManager().get_kernel_spec("python3")                      # the kernel `make lab` runs
    kernelspec = {"display_name": spec.display_name, "language": spec.language, "name": "python3"}

    cm = jupyter.ChapterContentsManager(root_dir=str(tmp_path))
    model = cm.get(chapter.name)
    assert model["type"] == "notebook" and model["content"].metadata["kernelspec"] == kernelspec, (
        f"{chapter.name}'s header names another kernel than `make lab` runs ({kernelspec}): "
        "JupyterLab would rewrite it on the first save")
    _jupyterlab_after_a_run(model["content"], kernelspec)
    cm.save(model, f"{jupyter.MINE}/{chapter.name}")
    saved = (tmp_path / jupyter.MINE / chapter.name).read_text()
    assert saved == chapter.read_text(), f"a run changes {chapter.name} as saved from JupyterLab"
    assert (tmp_path / chapter.name).read_bytes() == chapter.read_bytes()


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_opens_with_the_metadata_its_kernel_will_report(chapter, kernel_info, tmp_path):
    """Nothing for JupyterLab to change on opening a chapter, so it opens saved: the kernelspec as the file
    names it, the language_info as the running kernel reports it."""
    pytest.importorskip("jupyter_server", reason="the [lab] extra (make lab) is not installed")
    shutil.copy(chapter, tmp_path / chapter.name)
    shutil.copy(ROOT / "notebooks" / "jupytext.toml", tmp_path / "jupytext.toml")
    meta = jupyter.ChapterContentsManager(root_dir=str(tmp_path)).get(chapter.name)["content"].metadata
    assert meta["kernelspec"] == kernel_info["kernelspec"]
    assert meta.get("language_info") == kernel_info["language_info"], (
        f"{chapter.name} opens without the language_info its kernel reports: JupyterLab fills it in and shows "
        "the chapter unsaved before anything ran")
    assert (tmp_path / chapter.name).read_bytes() == chapter.read_bytes()      # opening writes nothing


@pytest.fixture(scope="module")
def kernel_info():
    """The `python3` kernel `make lab` starts, asked for its kernel_info as JupyterLab asks on connecting."""
    pytest.importorskip("jupyter_client")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import start_new_kernel

    spec = KernelSpecManager().get_kernel_spec("python3")
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        reply = kc.kernel_info(reply=True, timeout=60)["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return {"language_info": reply["language_info"],
            "kernelspec": {"display_name": spec.display_name, "language": spec.language, "name": "python3"}}


def test_a_readers_edit_is_saved(tmp_path):
    """The filters keep a run from changing the file, not a reader's edit: a changed cell is written."""
    pytest.importorskip("jupyter_server", reason="the [lab] extra (make lab) is not installed")

    chapter = CHAPTERS[0]
    shutil.copy(chapter, tmp_path / chapter.name)
    shutil.copy(ROOT / "notebooks" / "jupytext.toml", tmp_path / "jupytext.toml")
    cm = jupyter.ChapterContentsManager(root_dir=str(tmp_path))
    model = cm.get(chapter.name)
    code = next(c for c in model["content"].cells if c.cell_type == "code")
    code.source += "\nprint('my note')"
    code.metadata["tags"] = ["mine"]
    cm.save(model, f"{jupyter.MINE}/{chapter.name}")
    saved = (tmp_path / jupyter.MINE / chapter.name).read_text()
    assert "print('my note')" in saved and 'tags=["mine"]' in saved


# Slow: JupyterLab and headless Chromium start, the chapter's first cell imports torch and transformers
# (12-30 s here). `make test-slow` runs it; it skips where JupyterLab is not installed (the [lab] extra) or no
# Chromium can be found or installed (lab.book.screens.chromium installs Debian's package when run as root).
@pytest.mark.slow
def test_a_double_click_in_jupyterlab_opens_a_chapter_read_only_and_an_answer_goes_to_the_readers_copy():
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
    assert seen["writable"] is False and not seen["dirty_on_open"]            # read-only, opened saved
    assert not seen["autosaved_chapter"] and "read-only" in seen["ctrl_s"]      # autosave, Ctrl+S: no write
    assert seen["copy"]["answer"] and seen["copy"]["autosaved"] and seen["copy"]["writable"]
    assert seen["copy"]["path"].startswith(f"{jupyter.MINE}/")
    assert not seen["news_prompt"]
    assert seen["unchanged"] and seen["git_status"] == seen["git_status_before"]
