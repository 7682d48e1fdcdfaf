"""JupyterLab on the chapters, as `make lab` starts it, and a check of it in a real browser.

    python -m lab.jupyter [options]   # `make lab`: JupyterLab on notebooks/; a double-click opens a chapter
                                      # as a notebook (options go to `jupyter lab`, e.g. --port=8890)
    python -m lab.jupyter --check     # `make lab-check`: the same JupyterLab driven by headless Chromium

A chapter is a percent-format `.py` file. jupytext's contents manager reads it as a notebook, but JupyterLab
opens a `.py` in its text editor unless the default viewer of Python files is jupytext's "Jupytext Notebook".
`set_default_viewer` writes that into this environment's own settings overrides
(`<sys.prefix>/share/jupyter/lab/settings/overrides.json`, read by this JupyterLab only; the reader's home is
left alone, and a viewer the reader chose in their own settings still wins).

Saving a chapter writes the `.py` back through jupytext: the cells, never the outputs. `notebooks/jupytext.toml`
keeps jupytext's version lines out of the header, and each chapter's header names the kernel as `make lab`'s
kernel names itself ("Python 3 (ipykernel)"), so a chapter that was only opened, run and saved is byte for
byte the committed file (`tests/test_jupyterlab.py` checks every chapter; the check below does it in the
browser).

The check starts JupyterLab exactly as `make lab` does (on a free port, with a known token, no browser of its
own), opens it in headless Chromium over the DevTools protocol, double-clicks the chapter in the file
browser, asserts the notebook view (cells, no text editor), runs the first code cell and reads its output,
saves with Ctrl+S, and asserts the file and `git status --porcelain notebooks/` are as before.
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


def default_viewers(path=None) -> dict:
    path = Path(path or overrides_path())
    doc = json.loads(path.read_text()) if path.exists() else {}
    return doc.get("@jupyterlab/docmanager-extension:plugin", {}).get("defaultViewers", {})


def command(*extra, notebooks=NOTEBOOKS) -> list[str]:
    """`jupyter lab` on notebooks/ with jupytext's contents manager (a chapter's .py is read as a notebook)."""
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={notebooks}",
            "--ServerApp.contents_manager_class=jupytext.TextFileContentsManager", *root, *extra]


def run(*extra):
    set_default_viewer()
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


def check(chapter="ch01_recompute.py", notebooks=NOTEBOOKS, timeout=240, screens=SCREENS) -> dict:
    """Open `chapter` in JupyterLab as a reader does and return what was seen; LabCheckError if it is not a
    notebook, its first code cell gives no output, or saving it changed the file or `git status`."""
    from .book.screens import chromium

    notebooks = Path(notebooks)
    path = notebooks / chapter
    if not path.exists():
        raise LabCheckError(f"{path} does not exist")
    port, token = free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    before = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "git": git_status(notebooks)}
    seen = {"chapter": chapter, "viewers": default_viewers(set_default_viewer())}
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

            def modified():                          # the file's time as the server sees it
                return _get(f"{base}/api/contents/{chapter}?content=0&token={token}")["last_modified"]

            mtime0 = modified()
            print(f"JupyterLab up on port {port} in {time.monotonic() - t0:.1f} s", flush=True)

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
            if not page.js("!!document.querySelector('.jp-FileBrowser')?.offsetParent"):
                xy = page.wait(f"{_CENTRE}(document.querySelector('[data-id=\"filebrowser\"]'))", 30,
                               "the file browser's tab")
                page.click(*xy)
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

            # run the first code cell once its kernel is idle, as a reader does: click into it, Shift+Enter
            def kernel_state():
                sessions = _get(f"{base}/api/sessions?token={token}")
                return next((s["kernel"]["execution_state"] for s in sessions if s["path"] == chapter), None)

            wait_for(lambda: kernel_state() == "idle", timeout, f"{chapter}'s kernel to start")
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

            # save (Ctrl+S), then wait until the server has the new file and the tab is clean
            page.key("s", "KeyS", 83, modifiers=2)
            wait_for(lambda: modified() != mtime0 and not page.js(_VIEW)["dirty"], 60, f"{chapter} to be saved")
            seen["saved"] = True
            print(f"saved with Ctrl+S: the server's copy changed ({mtime0} -> {modified()}), the tab is clean",
                  flush=True)
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

    after = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "git": git_status(notebooks)}
    seen["unchanged"] = after["sha256"] == before["sha256"]
    seen["git_status"] = after["git"]
    print(f"git status --porcelain {_shown(notebooks)} after the save: "
          + ("(not a git checkout)" if after["git"] is None else repr(after["git"]) if after["git"] else "(empty)"),
          flush=True)
    if not seen["unchanged"]:
        raise LabCheckError(f"saving {chapter} after a run changed the file: see `git diff {_shown(path)}`")
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
    print(f"lab-check passed: {args.chapter} opened as a notebook ({seen['view']['cells']} cells), its first "
          f"cell ran, and saving it left the file and `git status` as they were", flush=True)


if __name__ == "__main__":
    main()
