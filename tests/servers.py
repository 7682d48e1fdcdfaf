"""Servers for the server and load-generator tests (tests/test_serve.py, tests/test_defects_serve.py,
tests/test_loadgen.py): the lab's HTTP app served by uvicorn in a thread, or `python -m lab.serve` as a
process of its own."""

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from lab.serve import create_app

ROOT = Path(__file__).resolve().parent.parent


def call(port, path, body=None, method="POST"):
    """(status, parsed JSON body) of one request; `body` a dict, or bytes sent as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


@contextmanager
def serving(engine, **kw):
    """The app over `engine`, served by uvicorn in a thread on a free 127.0.0.1 port; yields (port, app)."""
    app = create_app(engine, **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1], app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def health(port) -> int | None:
    """The status of GET /health, or None if nothing listens on `port`."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return None


@contextmanager
def serve_process(*args, timeout_s: float = 60):
    """`python -m lab.serve --port P *args` as a process, once its /health answers 200; yields (process,
    port) with its output in `process.stdout`; kills it if it still runs at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "lab.serve", "--port", str(port), *args]
    proc = subprocess.Popen(command, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while health(port) != 200:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
