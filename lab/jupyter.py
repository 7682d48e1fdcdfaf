"""JupyterLab on the chapters, as `make lab` starts it, and a check of it in a real browser.

    python -m lab.jupyter [options]   # `make lab`: JupyterLab on notebooks/; a double-click opens a chapter
                                      # as a notebook (options go to `jupyter lab`, e.g. --port=8890)
    python -m lab.jupyter --check     # `make lab-check`: the same JupyterLab driven by headless Chromium

A chapter is a percent-format `.py` file. jupytext's contents manager reads it as a notebook, but JupyterLab
opens a `.py` in its text editor unless the default viewer of Python files is jupytext's "Jupytext Notebook".
`configure` writes that, and the rest of `SETTINGS`, into this environment's own settings overrides
(`<sys.prefix>/share/jupyter/lab/settings/overrides.json`, read by this JupyterLab only; the reader's home is
left alone, and what the reader chose in their own settings still wins).

The chapters are the book's: git tracks them, and `git pull` brings the next edition. So JupyterLab serves
them read-only (`ChapterContentsManager`, jupytext's contents manager with three rules):
- a file git tracks under notebooks/ is not writable: JupyterLab's autosave passes it by, Ctrl+S says
  "read-only, use Save as…", and the server refuses to save, rename or delete it. A reader runs and edits a
  chapter freely and keeps the edits with File > Save Notebook As… `mine/<chapter>.py`: `notebooks/mine/`
  is the reader's, ignored by git (created by `make lab`, or by the first save there), and everything in it
  autosaves as usual. `git pull` never touches it and never conflicts with it.
- a notebook opens with the `language_info` the kernel will report (jupytext keeps it out of the `.py`):
  without it JupyterLab fills the field in itself, then again when the kernel answers, and a chapter that was
  only opened shows as unsaved. Each chapter's header names the kernel as `make lab`'s kernel names itself
  ("Python 3 (ipykernel)") for the same reason.
- saving writes the `.py` through jupytext: the cells, never the outputs. `notebooks/jupytext.toml` keeps
  jupytext's version lines out of the header, so a reader's copy saved after a run and no edit is byte for
  byte the chapter (`tests/test_jupyterlab.py`), and `diff notebooks/chNN_x.py notebooks/mine/chNN_x.py` shows
  the reader's answers and nothing else.

The check starts JupyterLab exactly as `make lab` does (on a free port, with a known token, no browser of its
own), opens it in headless Chromium over the DevTools protocol, double-clicks the chapter in the file
browser, asserts the notebook view (cells, no text editor) and that it opens saved (not dirty), runs the first
code cell and reads its output, writes an answer into it, asserts that Ctrl+S leaves the chapter as it was,
saves it as a reader's copy under mine/ (File > Save Notebook As…) and asserts the copy holds the answer,
`git status --porcelain notebooks/` is as before, and no prompt about Jupyter's news was shown.
"""

import argparse
import base64
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
VIEWER = "Jupytext Notebook"          # the document factory jupytext's JupyterLab extension registers
SCREENS = ROOT / "build" / "lab-check"
MINE = "mine"                         # notebooks/mine/: the reader's copies of the chapters (.gitignore'd)

# This environment's JupyterLab settings, beside the default viewer (plugin id -> {setting: value}):
SETTINGS = {
    # no "Would you like to get notified about official Jupyter news?" prompt (and no request to the
    # network for news or for a newer JupyterLab, which the pinned environment would not install anyway)
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"},
}


class LabCheckError(RuntimeError):
    """JupyterLab did not do what a reader expects: what was expected and what the page showed."""


# ---- make lab ------------------------------------------------------------------------------------------------

def overrides_path() -> Path:
    """This environment's JupyterLab settings overrides: `<app dir>/settings/overrides.json`."""
    return Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"


def set_default_viewer(path=None) -> Path:
    """Python files open as notebooks in this environment's JupyterLab: `jupytext-config set-default-viewer
    python` into the overrides file (idempotent; other settings there are kept, and so is a viewer already
    chosen for Python files)."""
    path = Path(path or overrides_path())
    subprocess.run([sys.executable, "-m", "jupytext_config", "--settings-file", str(path),
                    "set-default-viewer", "python"], check=True)
    return path


def configure(path=None) -> Path:
    """The default viewer and `SETTINGS` into the overrides file (idempotent; other settings there are kept)."""
    path = set_default_viewer(path)
    doc = json.loads(path.read_text())
    for plugin, values in SETTINGS.items():
        doc.setdefault(plugin, {}).update(values)
    text = json.dumps(doc, indent=2) + "\n"
    if path.read_text() != text:
        path.write_text(text)
    return path


def default_viewers(path=None) -> dict:
    path = Path(path or overrides_path())
    doc = json.loads(path.read_text()) if path.exists() else {}
    return doc.get("@jupyterlab/docmanager-extension:plugin", {}).get("defaultViewers", {})


def book_files(root) -> set[str]:
    """The book's own files under `root`, as contents paths ('/'-separated, relative to it): the files git
    tracks there; outside a git checkout (a tarball), the chapters and jupytext.toml at its top."""
    root = Path(root)
    done = (subprocess.run(["git", "ls-files", "-z", "--", "."], cwd=root, capture_output=True, text=True)
            if shutil.which("git") else None)
    if done is not None and done.returncode == 0:
        return {p for p in done.stdout.split("\0") if p}
    return {p.name for p in root.glob("ch[0-9][0-9]_*.py")} | {p.name for p in root.glob("jupytext.toml")}


def kernel_language_info() -> dict:
    """What the `python3` kernel `make lab` starts (ipykernel in this interpreter: jupyter_client runs a
    kernelspec's `python` as sys.executable) reports as its language_info."""
    from ipykernel.ipkernel import IPythonKernel

    return json.loads(json.dumps(IPythonKernel.language_info))


def _contents_manager_class():
    from jupytext import TextFileContentsManager
    from tornado import web

    class ChapterContentsManager(TextFileContentsManager):
        """jupytext's contents manager with the book's files read-only and notebooks opened with the kernel's
        language_info (the module's docstring says why)."""

        book_files_ttl = 2.0       # seconds: the file browser asks about every file every few seconds

        def book_file(self, path) -> bool:
            now = time.monotonic()
            cached = getattr(self, "_book_files", None)
            if cached is None or now - cached[0] > self.book_files_ttl:
                cached = self._book_files = (now, book_files(self.root_dir))
            return path.strip("/") in cached[1]

        def _refuse(self, path, doing):
            raise web.HTTPError(403, f"{path} is the book's own file, read-only so that `git pull` can update it: "
                                     f"{doing} a copy under {MINE}/ instead (File > Save Notebook As… "
                                     f"{MINE}/{path.strip('/').rsplit('/', 1)[-1]})")

        def is_writable(self, path):
            return not self.book_file(path) and super().is_writable(path)

        def get(self, path, content=True, type=None, format=None, require_hash=False):
            extra = {"require_hash": True} if require_hash else {}
            model = super().get(path, content=content, type=type, format=format, **extra)
            nb = model.get("content") if model["type"] == "notebook" else None
            if nb is not None and "language_info" not in nb.metadata \
                    and nb.metadata.get("kernelspec", {}).get("name") == "python3":
                nb.metadata["language_info"] = kernel_language_info()
            return model

        def save(self, model, path=""):
            if self.book_file(path):
                self._refuse(path, "save")
            parent = path.strip("/").rpartition("/")[0]
            if parent.split("/")[0] == MINE:                      # the reader's folder, made on the first save
                os.makedirs(self._get_os_path(parent), exist_ok=True)
            return super().save(model, path)

        def rename_file(self, old_path, new_path):
            if self.book_file(old_path):
                self._refuse(old_path, "rename")
            return super().rename_file(old_path, new_path)

        def delete_file(self, path):
            if self.book_file(path):
                self._refuse(path, "delete")
            return super().delete_file(path)

    ChapterContentsManager.__module__ = "lab.jupyter"
    ChapterContentsManager.__qualname__ = "ChapterContentsManager"
    return ChapterContentsManager


def __getattr__(name):
    # `lab.jupyter.ChapterContentsManager`, built on first use: jupyter_server (the [lab] extra) is imported
    # only by the server that uses it, so this module imports without it.
    if name == "ChapterContentsManager":
        cls = globals()["ChapterContentsManager"] = _contents_manager_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def command(*extra, notebooks=NOTEBOOKS) -> list[str]:
    """`jupyter lab` on notebooks/ with the chapters' contents manager (a chapter's .py is read as a notebook,
    and the book's own files are read-only)."""
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={notebooks}",
            "--ServerApp.contents_manager_class=lab.jupyter.ChapterContentsManager", *root, *extra]


def run(*extra):
    configure()
    (NOTEBOOKS / MINE).mkdir(exist_ok=True)
    print(f"The chapters open read-only; keep your answers with File > Save Notebook As… {MINE}/<chapter>.py "
          f"({_shown(NOTEBOOKS / MINE)}/, yours: git ignores it, and `git pull` leaves it alone).", flush=True)
    os.chdir(NOTEBOOKS)
    os.execv(sys.executable, command(*extra))


# ---- the browser check ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(probe, timeout, what, interval=0.25):
    """probe() until it returns something truthy; LabCheckError naming `what` after timeout seconds."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            if value := probe():
                return value
        except (OSError, ValueError) as e:          # a server not up yet, a page still loading
            last = e
        time.sleep(interval)
    raise LabCheckError(f"timed out after {timeout} s waiting for {what}" + (f" (last error: {last})" if last else ""))


class Page:
    """One browser tab over the DevTools protocol: evaluate JavaScript, click and type as a user does."""

    def __init__(self, ws_url, timeout=60):
        import websocket  # websocket-client (the [lab] extra; jupyter_server needs it too)

        self.ws = websocket.create_connection(ws_url, timeout=timeout, suppress_origin=True)
        self.next_id = 0

    def send(self, method, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:                                  # skip events until our answer arrives
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise LabCheckError(f"DevTools {method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise LabCheckError(f"JavaScript failed: {r['exceptionDetails'].get('exception', r['exceptionDetails'])}")
        return r["result"].get("value")

    def wait(self, expression, timeout, what):
        return wait_for(lambda: self.js(expression), timeout, what)

    def click(self, x, y, count=1):
        """Mouse down and up at (x, y), `count` times in a row: count=2 is a double-click (a `dblclick`)."""
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for n in range(1, count + 1):
            for kind in ("mousePressed", "mouseReleased"):
                self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=n)

    def key(self, key, code, key_code, modifiers=0):
        """A key press; modifiers: 2 Ctrl, 8 Shift (the DevTools bit mask)."""
        common = dict(key=key, code=code, windowsVirtualKeyCode=key_code, nativeVirtualKeyCode=key_code,
                      modifiers=modifiers)
        self.send("Input.dispatchKeyEvent", type="rawKeyDown", **common)
        self.send("Input.dispatchKeyEvent", type="keyUp", **common)

    def type(self, text):
        """Text typed into the focused element, as an input method inserts it."""
        self.send("Input.insertText", text=text)

    def screenshot(self, png: Path) -> Path:
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return png

    def close(self):
        self.ws.close()


def browser_command(browser, user_data_dir, width=1400, height=1000) -> list[str]:
    """Headless Chromium that never reaches for the network (without these flags it hangs offline)."""
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={user_data_dir}", "--remote-debugging-port=0",
            f"--window-size={width},{height}", "about:blank"]


def git_status(path) -> str | None:
    """`git status --porcelain <path>`, or None where this is not a git checkout."""
    if not shutil.which("git"):
        return None
    done = subprocess.run(["git", "status", "--porcelain", "--", str(path)], cwd=ROOT, capture_output=True,
                          text=True)
    return done.stdout if done.returncode == 0 else None


def _stop(proc, timeout=20):
    """SIGTERM to the process group this module started (the server and its kernels), then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


# JavaScript run in the page. An element's centre, for a real mouse event at it:
_CENTRE = "(e => { if (!e) return null; e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); " \
          "return (r.width && r.height) ? [r.x + r.width / 2, r.y + r.height / 2] : null; })"
_ITEM = ("[...document.querySelectorAll('.jp-FileBrowser .jp-DirListing-item')].find(e => "
         "e.querySelector('.jp-DirListing-itemText')?.textContent.trim() === {name})")
_MAIN = "document.querySelector('#jp-main-dock-panel')"
_VIEW = f"""(() => {{
  const main = {_MAIN};
  const visible = e => e && e.offsetParent !== null;
  const panel = [...main.querySelectorAll('.jp-NotebookPanel')].find(visible);
  const tab = document.querySelector('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel');
  return {{
    notebook: !!panel,
    cells: panel ? panel.querySelectorAll('.jp-Notebook .jp-Cell').length : 0,
    code_cells: panel ? panel.querySelectorAll('.jp-Notebook .jp-CodeCell').length : 0,
    markdown_cells: panel ? panel.querySelectorAll('.jp-Notebook .jp-MarkdownCell').length : 0,
    file_editors: [...main.querySelectorAll('.jp-FileEditor')].filter(visible).length,
    tab: tab ? tab.textContent.trim() : null,
    dirty: !!document.querySelector('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current.jp-mod-dirty'),
  }};
}})()"""
_FIRST_CODE = f"[...{_MAIN}.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-CodeCell')][0]"


def check(chapter="ch01_recompute.py", notebooks=NOTEBOOKS, timeout=240, screens=SCREENS, autosave_s=2) -> dict:
    """Open `chapter` in JupyterLab as a reader does and return what was seen; LabCheckError if it is not a
    notebook, it opens unsaved, its first code cell gives no output, autosave or Ctrl+S wrote an answer into
    it, its reader's copy under mine/ lacks the answers written into it (the second one by autosave alone),
    `git status` changed, or JupyterLab asked about its news. The check's JupyterLab autosaves every
    `autosave_s` seconds (a reader's every 120 s)."""
    from .book.screens import chromium

    notebooks = Path(notebooks)
    path = notebooks / chapter
    if not path.exists():
        raise LabCheckError(f"{path} does not exist")
    port, token = free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    mine = notebooks / MINE
    made = [d for d in (mine, mine / ".ipynb_checkpoints", notebooks / ".ipynb_checkpoints") if not d.exists()]
    copy = f"{MINE}/lab-check-{token[:8]}-{chapter}"     # never the reader's own mine/<chapter>
    answer = f"# my answer ({token[:8]})"
    before = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "git": git_status(notebooks)}
    seen = {"chapter": chapter, "viewers": default_viewers(configure())}
    if seen["viewers"].get("python") != VIEWER:
        raise LabCheckError(f"{overrides_path()} sets the viewer of Python files to "
                            f"{seen['viewers'].get('python')!r}, not {VIEWER!r}")
    browser = chromium()
    server = chrome = page = None
    with tempfile.TemporaryDirectory(prefix="lab-check-") as tmp:
        tmp = Path(tmp)
        # The reader's own settings and workspaces stay out of the check: a clean JupyterLab, this
        # environment's overrides only.
        env = os.environ | {"JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
                            "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"), "OMP_WAIT_POLICY": "PASSIVE"}
        docmanager = tmp / "settings" / "@jupyterlab" / "docmanager-extension" / "plugin.jupyterlab-settings"
        docmanager.parent.mkdir(parents=True)
        docmanager.write_text(json.dumps({"autosaveInterval": autosave_s}))
        log = open(tmp / "jupyter.log", "w")
        try:
            server = subprocess.Popen(
                command(f"--port={port}", "--ServerApp.ip=127.0.0.1", "--no-browser",
                        f"--IdentityProvider.token={token}", "--ServerApp.port_retries=0", notebooks=notebooks),
                cwd=notebooks, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            t0 = time.monotonic()

            def up():
                if server.poll() is not None:
                    raise LabCheckError(f"JupyterLab exited ({server.returncode}):\n"
                                        + (tmp / "jupyter.log").read_text()[-3000:])
                return _get(f"{base}/api/status?token={token}")

            wait_for(up, 120, "JupyterLab to answer")

            def stat(name=chapter):                  # the file as the server sees it, without its content
                return _get(f"{base}/api/contents/{name}?content=0&token={token}")

            mtime0 = stat()["last_modified"]
            seen["writable"] = stat()["writable"]
            print(f"JupyterLab up on port {port} in {time.monotonic() - t0:.1f} s; {chapter} writable: "
                  f"{seen['writable']}", flush=True)
            if seen["writable"]:
                raise LabCheckError(f"the server offers {chapter} as writable: JupyterLab would autosave a "
                                    "reader's edits into the book's file")

            profile = tmp / "chromium"
            chrome = subprocess.Popen(browser_command(browser, profile), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
            active = profile / "DevToolsActivePort"
            devtools = wait_for(lambda: active.exists() and active.read_text().split("\n")[0].strip(), 60,
                                "Chromium's DevTools port")
            targets = wait_for(lambda: [t for t in _get(f"http://127.0.0.1:{devtools}/json/list")
                                        if t.get("type") == "page"], 30, "a Chromium page")
            page = Page(targets[0]["webSocketDebuggerUrl"])
            page.send("Page.navigate", url=f"{base}/lab?token={token}")

            # the file browser (open on the left by default; its tab is clicked if it is not)
            item = _ITEM.replace("{name}", json.dumps(chapter))
            page.wait("!!document.querySelector('.jp-LabShell')", timeout, "JupyterLab's shell")
            shown = "!!document.querySelector('.jp-FileBrowser')?.offsetParent"
            try:                                     # laid out a little after the shell, later on a busy machine
                page.wait(shown, 30, "the file browser")
            except LabCheckError:
                xy = page.wait(f"{_CENTRE}(document.querySelector('[data-id=\"filebrowser\"]'))", 30,
                               "the file browser's tab")
                page.click(*xy)
                page.wait(shown, 30, "the file browser, its tab clicked")
            xy = page.wait(f"{_CENTRE}({item})", timeout, f"{chapter} in the file browser")
            print(f"file browser lists {chapter}; double-click", flush=True)
            page.click(*xy, count=2)

            # the notebook view, not the text editor
            view = page.wait(f"(v => v.notebook && v.cells > 0 ? v : (v.file_editors ? v : null))({_VIEW})",
                             timeout, f"{chapter} to open")
            seen["view"] = view
            if not view["notebook"] or view["file_editors"]:
                page.screenshot(screens / "opened.png")
                raise LabCheckError(f"a double-click on {chapter} opened {view} (a text editor, not a notebook)")
            cells = len(_get(f"{base}/api/contents/{chapter}?token={token}")["content"]["cells"])
            view = page.wait(f"(v => v.cells === {cells} ? v : null)({_VIEW})", 60,
                             f"all {cells} cells of {chapter} to render")   # they are added a few at a time
            seen["view"] = view
            print(f"opened as a notebook: {view['cells']} cells ({view['code_cells']} code, "
                  f"{view['markdown_cells']} markdown), tab {view['tab']!r}, text editors open: "
                  f"{view['file_editors']}", flush=True)

            def kernel_state():
                sessions = _get(f"{base}/api/sessions?token={token}")
                return next((s["kernel"]["execution_state"] for s in sessions if s["path"] == chapter), None)

            # opened and read, nothing run: saved (no unsaved mark on the tab), also once the kernel has
            # answered with its language_info
            wait_for(lambda: kernel_state() == "idle", timeout, f"{chapter}'s kernel to start")
            dirty = []
            for _ in range(12):
                dirty.append(page.js(_VIEW)["dirty"])
                time.sleep(0.25)
            seen["dirty_on_open"] = any(dirty)
            print(f"opened, kernel idle: the tab shows {'unsaved' if any(dirty) else 'saved'}", flush=True)
            if any(dirty):
                raise LabCheckError(f"{chapter} shows as unsaved (dirty) after it was only opened: closing it "
                                    "would ask to save")

            # run the first code cell, as a reader does: click into it, Shift+Enter
            xy = page.wait(f"{_CENTRE}({_FIRST_CODE}?.querySelector('.jp-InputArea-editor'))", 30,
                           "the first code cell")
            page.click(*xy)
            page.wait(f"{_FIRST_CODE}.classList.contains('jp-mod-active')", 10, "the first code cell to be active")
            page.key("Enter", "Enter", 13, modifiers=8)
            page.wait(f"{_FIRST_CODE}.querySelector('.jp-InputPrompt').innerText.trim() !== '[ ]:'", 10,
                      "the first code cell to run (its prompt to change from [ ]:)")
            output = page.wait(f"(o => o && o.innerText.includes('torch') ? o.innerText : null)"
                               f"({_FIRST_CODE}?.querySelector('.jp-OutputArea-output'))", timeout,
                               "the first code cell's output")
            seen["output"] = output.strip()
            seen["prompt"] = page.js(f"{_FIRST_CODE}.querySelector('.jp-InputPrompt').innerText.trim()")
            print(f"first code cell ran, prompt {seen['prompt']}; output:", flush=True)
            print("  " + seen["output"].replace("\n", "\n  "), flush=True)
            if screens:
                page.screenshot(Path(screens) / "notebook.png")

            def write(line):                         # click into the first code cell, go to its end, type a line
                xy = page.wait(f"{_CENTRE}({_FIRST_CODE}?.querySelector('.jp-InputArea-editor'))", 30,
                               "the first code cell")
                page.click(*xy)
                page.wait("!!document.activeElement?.closest('.jp-InputArea-editor')", 10, "the cell's editor")
                page.key("End", "End", 35, modifiers=2)
                page.key("Enter", "Enter", 13)
                page.type(line)
                page.wait(f"{_FIRST_CODE}.querySelector('.jp-InputArea-editor').innerText.includes("
                          f"{json.dumps(line)})", 10, "the answer in the cell")

            # an answer in the chapter, then three autosave intervals: the chapter stays as it was
            write(answer)
            time.sleep(3 * autosave_s + 1)
            if stat()["last_modified"] != mtime0 or hashlib.sha256(path.read_bytes()).hexdigest() != before["sha256"]:
                raise LabCheckError(f"autosave wrote a reader's answer into {chapter}, a file of the book")
            seen["autosaved_chapter"] = False
            print(f"an answer typed into the chapter, {3 * autosave_s + 1} s of autosave every {autosave_s} s: "
                  "the file is as it was", flush=True)

            # Ctrl+S on the chapter: JupyterLab says it is read-only, the file stays as it was
            page.key("s", "KeyS", 83, modifiers=2)
            note = page.wait("[...document.querySelectorAll('.Toastify__toast, .jp-Notification-Toast')]"
                             ".map(e => e.innerText).find(t => t.includes('read-only')) || null", 30,
                             "JupyterLab's note that the chapter is read-only")
            seen["ctrl_s"] = " ".join(note.split())
            time.sleep(1)
            if stat()["last_modified"] != mtime0:
                raise LabCheckError(f"Ctrl+S wrote {chapter}, a file of the book")
            print(f"Ctrl+S on the chapter: {seen['ctrl_s']!r}; the file is as it was", flush=True)

            # File > Save Notebook As… mine/<name>: the reader's copy, with the answer, and the tab follows it
            page.key("S", "KeyS", 83, modifiers=2 | 8)
            xy = page.wait(f"{_CENTRE}(document.querySelector('.jp-Dialog input'))", 30, "the Save As dialog")
            page.click(*xy)
            page.wait("document.activeElement === document.querySelector('.jp-Dialog input')", 10,
                      "the dialog's path field")
            page.key("a", "KeyA", 65, modifiers=2)
            page.type(copy)
            page.key("Enter", "Enter", 13)

            def copied():
                try:
                    return answer in (notebooks / copy).read_text()
                except FileNotFoundError:
                    return False

            wait_for(copied, 60, f"{copy} with the answer")
            # JupyterLab then closes the chapter's tab, and asks first since its edits were not saved there
            xy = page.wait(f"{_CENTRE}([...document.querySelectorAll('.jp-Dialog button')]"
                           ".find(b => b.innerText.trim() === 'Discard'))", 30,
                           "JupyterLab's question about the chapter's unsaved edits")
            page.click(*xy)
            name = copy.rsplit("/", 1)[-1]
            view = page.wait(f"(v => v.notebook && v.tab === {json.dumps(name)} && !v.dirty ? v : null)({_VIEW})",
                             60, f"the tab of {copy}, saved")
            seen["copy"] = {"path": copy, "answer": True, "writable": stat(copy)["writable"], "tab": view["tab"]}
            print(f"saved as {copy}: the answer is in it, its tab is open and saved; the chapter's tab closed "
                  "(Discard)", flush=True)

            # a second answer in the copy: autosave writes it, no Ctrl+S
            second = answer.replace("my answer", "my second answer")
            write(second)
            wait_for(lambda: second in (notebooks / copy).read_text(), 10 * autosave_s + 30,
                     f"autosave to write the second answer into {copy}")
            seen["copy"]["autosaved"] = True
            print(f"a second answer in the copy: autosave wrote it to {copy}", flush=True)
            seen["news_prompt"] = page.js("document.body.innerText.includes('Jupyter news')")
            if seen["news_prompt"]:
                raise LabCheckError("JupyterLab asks whether to fetch Jupyter's news: "
                                    f"{SETTINGS} is not in effect ({overrides_path()})")
            if screens:
                page.screenshot(Path(screens) / "copy.png")
        except LabCheckError:
            if page is not None and screens:
                shot = page.screenshot(Path(screens) / "failure.png")
                print(f"the page when the check failed: {_shown(shot)}", flush=True)
            raise
        finally:
            if page is not None:
                page.close()
            _stop(chrome)
            _stop(server)
            log.close()
            # the check's copy and its checkpoint go, and the folders the check made if they are empty
            (notebooks / copy).unlink(missing_ok=True)
            for f in (mine / ".ipynb_checkpoints").glob(f"{Path(copy).stem}-checkpoint*"):
                f.unlink()
            for d in sorted(made, key=lambda d: len(d.parts), reverse=True):        # the deepest first
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()

    after = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "git": git_status(notebooks)}
    seen["unchanged"] = after["sha256"] == before["sha256"]
    seen["git_status"], seen["git_status_before"] = after["git"], before["git"]
    print(f"git status --porcelain {_shown(notebooks)} after: "
          + ("(not a git checkout)" if after["git"] is None else repr(after["git"]) if after["git"] else "(empty)"),
          flush=True)
    if not seen["unchanged"]:
        raise LabCheckError(f"{chapter} changed: see `git diff {_shown(path)}`")
    if after["git"] != before["git"]:
        raise LabCheckError(f"git status of {_shown(notebooks)} changed: {before['git']!r} -> {after['git']!r}")
    return seen


def _shown(path) -> str:
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False, allow_abbrev=False)
    parser.add_argument("--check", action="store_true", help="the browser check (make lab-check)")
    parser.add_argument("--chapter", default="ch01_recompute.py", help="with --check: the chapter to open")
    args, extra = parser.parse_known_args(argv)
    if not args.check:
        return run(*extra)
    if extra:
        parser.error(f"--check takes no other options: {extra}")
    seen = check(args.chapter)
    print(f"lab-check passed: {args.chapter} opened as a notebook ({seen['view']['cells']} cells) and saved, its "
          f"first cell ran, Ctrl+S left it as it was, an answer went to a copy under {MINE}/, and `git status` "
          "is as it was", flush=True)


if __name__ == "__main__":
    main()
