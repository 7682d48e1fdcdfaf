"""
The book in headless Chromium (`python -m lab.book --screens`, `make book-check`): a full-page PNG of every page
render() wrote, and every table measured against the text column it sits in.

    screens(pages, out_dir)          # out_dir/NAME.png for each page, shot in tiles and stacked
    wide_tables(browser, page)       # the tables of page wider than the column, described; [] when all fit

The browser is found on the PATH, or installed from Debian's `chromium` package when this runs as root.
"""

import html
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from lab.book.render import BookError, _console


def chromium() -> str:
    """The headless browser; installs Debian's `chromium` package when none is found and this is root."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        raise BookError("the browser check needs headless Chromium: install it "
                        "(Debian/Ubuntu: `sudo apt-get install chromium`) and run again")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print("installing chromium (apt-get) for the browser check ...", flush=True)
    subprocess.run(["apt-get", "update"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "chromium"], check=True, env=env)
    return shutil.which("chromium") or "chromium"


def _browser(browser, *args, timeout=180) -> str:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio",
           "--no-first-run", "--disable-dev-shm-usage", "--run-all-compositor-stages-before-draw",
           "--virtual-time-budget=5000", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise BookError(f"{Path(browser).name} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return done.stdout


def _with_extra(page: Path, extra: str, tag: str) -> Path:
    """A copy of page, beside it (so its figures resolve), with extra inserted before </body>."""
    copy = page.with_name(f".{tag}-{page.name}")
    copy.write_text(page.read_text().replace("</body>", f"{extra}\n</body>"))
    return copy


def page_height(browser, page: Path, width) -> int:
    """The height in CSS pixels of page laid out at width, as the browser measures it."""
    probe = _with_extra(page, "<script>window.addEventListener('load', () => { document.title = "
                              "'HEIGHT=' + Math.ceil(document.documentElement.scrollHeight); });</script>",
                        "measure")
    try:
        dom = _browser(browser, f"--window-size={width},1000", "--dump-dom", probe.as_uri())
    finally:
        probe.unlink(missing_ok=True)
    m = re.search(r"HEIGHT=(\d+)", dom)
    if not m:
        raise BookError(f"could not measure the height of {page.name} in the browser")
    return int(m[1])


def screenshot(browser, page: Path, png: Path, width=1280, tile=4000) -> Path:
    """A full-page PNG of page: the page is measured, shot in tiles of `tile` pixels, and the tiles stacked."""
    from PIL import Image

    height = page_height(browser, page, width)
    tiles = []
    with tempfile.TemporaryDirectory(prefix="book-screens-") as tmp:
        for k, top in enumerate(range(0, height, tile)):
            h = min(tile, height - top)
            shifted = _with_extra(page, f"<style>html {{ overflow: hidden; }} "
                                        f"body {{ transform: translateY(-{top}px); }}</style>", f"tile{k}")
            shot = Path(tmp) / f"{k}.png"
            try:
                _browser(browser, f"--window-size={width},{h}", f"--screenshot={shot}", shifted.as_uri())
            finally:
                shifted.unlink(missing_ok=True)
            tiles.append(Image.open(shot).convert("RGB").crop((0, 0, width, h)))
        whole = Image.new("RGB", (width, height), "white")
        for k, im in enumerate(tiles):
            whole.paste(im, (0, k * tile))
        png.parent.mkdir(parents=True, exist_ok=True)
        whole.save(png, optimize=True)
    return png


# every table's width against the width its container leaves it (the text column), as the browser lays it out
TABLE_WIDTHS = """<script>window.addEventListener('load', () => {
  const out = [];
  document.querySelectorAll('table').forEach(t => {
    const box = t.parentElement, style = getComputedStyle(box);
    const column = box.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    const head = t.rows.length ? t.rows[0].textContent.replace(/\\s+/g, ' ').trim().slice(0, 70) : '';
    out.push([t.scrollWidth, Math.floor(column), head]);
  });
  document.title = 'TABLES=' + JSON.stringify(out);
});</script>"""


def wide_tables(browser, page: Path, width=1280) -> list[str]:
    """The tables of page wider than the text column at a window `width` CSS pixels wide (a table's
    scrollWidth against its container's content width), described; an empty list when all fit."""
    import json

    probe = _with_extra(page, TABLE_WIDTHS, "tables")
    try:
        dom = _browser(browser, f"--window-size={width},1000", "--dump-dom", probe.as_uri())
    finally:
        probe.unlink(missing_ok=True)
    m = re.search(r"<title>TABLES=(.*?)</title>", dom, re.DOTALL)
    if not m:
        raise BookError(f"could not measure the tables of {page.name} in the browser")
    return [f"{page.name}: table {i} ({head!r} ...) is {wide} px wide, the column {column} px: shorten its "
            f"headers, drop a column, or break a header with <br>"
            for i, (wide, column, head) in enumerate(json.loads(html.unescape(m[1])), 1) if wide > column]


def screens(pages, out_dir, width=1280) -> list[Path]:
    """A full-page screenshot of each page (every page render() wrote), out_dir/NAME.png."""
    browser = chromium()
    shots = []
    for page in pages:
        png = screenshot(browser, Path(page), Path(out_dir) / f"{Path(page).stem}.png", width)
        print(f"screenshot {_console(png)} ({_size(png)})", flush=True)
        shots.append(png)
    return shots


def _size(png) -> str:
    """A PNG's width×height from its header (opening print.html's PNG would trip PIL's size guard)."""
    import struct

    with open(png, "rb") as f:
        width, height = struct.unpack(">II", f.read(24)[16:24])   # IHDR: the first chunk, after the signature
    return f"{width}×{height}"
