"""Servers as processes (chapter 8): `python -m lab.serve`, or any server with a /health endpoint, started in a
session of its own on chosen cores, waited for, and stopped with whatever it started.

    with lab_server(cores="0-1", threads=2) as (process, url):
        ...                                   # url: http://127.0.0.1:<a free port>

`server_process(command, env, port, timeout_s)` does the same for another server's command (lab.loadgen's
vllm_server). A server that exits or is not ready in time raises RuntimeError with the tail of its log.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from ..threads import peer_env

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list, env: dict, base_url: str, timeout_s: float) -> subprocess.Popen:
    """Run `command` in a session of its own, its output in a log file (`process.log_path`), and wait until
    `{base_url}/health` answers 200. RuntimeError with the log's tail if it exits or times out first."""
    log = tempfile.NamedTemporaryFile("w", prefix="lab-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.log_path = Path(log.name)
    log.close()
    deadline = time.monotonic() + timeout_s
    while True:
        exited, late = proc.poll() is not None, time.monotonic() > deadline
        if exited or late:
            code = stop_server(proc)
            tail = proc.log_path.read_text(errors="replace")[-3000:]
            proc.log_path.unlink(missing_ok=True)
            why = f"exited with code {code}" if exited else f"was not ready within {timeout_s} s"
            raise RuntimeError(f"the server {why}:\n{' '.join(command)}\n{tail}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc
        time.sleep(0.2)


def stop_server(proc, timeout_s: float = 60) -> int:
    """SIGTERM to the server and wait for it (SIGKILL after `timeout_s`); then SIGTERM and a second later
    SIGKILL to whatever is left of its session (vLLM's engine core, say). Its exit code."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.killpg(proc.pid, signal.SIGTERM)   # its own children, by its session's id: ProcessLookupError if none
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


@contextlib.contextmanager
def exit_on_sigterm():
    """While the block runs, SIGTERM raises SystemExit(143) in the main thread instead of ending the process at
    once, so that the `finally` blocks stopping servers run: a server lives in a session of its own and would
    outlive a parent stopped with `kill`. Nothing changes off the main thread or where a handler is already set
    (an outer block's, or a program's own)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def server_process(command: list, env: dict, port: int, timeout_s: float):
    """Start the server (start_server) on 127.0.0.1:`port`, yield (process, base_url), stop it (stop_server),
    also when this process is sent SIGTERM (exit_on_sigterm)."""
    base_url = f"http://127.0.0.1:{port}"
    with exit_on_sigterm():
        proc = start_server(command, env, base_url, timeout_s)
        try:
            yield proc, base_url
        finally:
            stop_server(proc)
            proc.log_path.unlink(missing_ok=True)


def pinned(cores: str | None) -> list:
    """The prefix that runs a command on `cores` only (e.g. "0-1"); nothing for cores=None."""
    return ["taskset", "-c", cores] if cores else []


def lab_server(model: str = "smollm2", cores: str | None = "0-1", threads: int | None = None,
               port: int | None = None, timeout_s: float = 120, **engine_args):
    """`python -m lab.serve` on `cores`, as a context manager yielding (process, base_url), started as a
    user starts it: the environment without this process's OpenMP settings, torch's own thread count unless
    `threads`. engine_args become its flags: num_pages=512, page_size=16, max_batch_tokens=256,
    prefix_caching=False (--no-prefix-caching), one_process=True (--one-process: the engine stepped in the
    server's own process, not in a process of its own), wait_policy="passive" (--wait-policy)."""
    port = port or free_port()
    command = pinned(cores) + [sys.executable, "-m", "lab.serve", "--model", model, "--host", "127.0.0.1",
                               "--port", str(port)] + (["--threads", str(threads)] if threads else [])
    for name, arg in engine_args.items():
        if name == "prefix_caching":
            command += [] if arg else ["--no-prefix-caching"]
        elif name == "one_process":
            command += ["--one-process"] if arg else []
        else:
            command += ["--" + name.replace("_", "-"), str(arg)]
    env = {k: v for k, v in peer_env(PYTHONPATH=ROOT).items() if k != "LAB_OMP_DEFAULT"}
    return server_process(command, env, port, timeout_s)
