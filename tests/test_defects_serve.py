"""Regression tests for defects of the server (`python -m lab.serve`, lab/serve/), one named test each.

Oracles: the same prompt ids through a fresh ServingEngine's `generate` (itself checked against each
request decoded alone, tests/test_serving.py), tokens equal with no tolerance; OpenAI's error shape; the
engine's own record of what it computed. Timing bounds are stated where a test has one.
"""

import dataclasses
import http.client
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from safetensors.torch import save_file
from servers import call, health, serve_process, serving

from lab.engine import ServingEngine
from lab.models import load
from lab.models.load import RANDOM, smollm2_folder
from lab.models.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
NUM_PAGES, PAGE_SIZE = 64, 16                       # 1,024 positions; tiny-llama has 2,048


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def server(tiny):
    engine = ServingEngine(tiny, NUM_PAGES, PAGE_SIZE, max_batch_tokens=64)
    with serving(engine) as (port, app):
        yield port, app, engine


def send(port, body: dict) -> http.client.HTTPConnection:
    """Send a completion request and leave its answer unread."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


def wait_until(condition, timeout=30, what="the condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def leave(conn):
    """The client goes away."""
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def assert_openai_error(status, body, want_status, param=None):
    assert status == want_status, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"] == param, body


# ---- 3: a model folder in the default two-process mode ----
def test_a_model_folder_serves_in_two_process_mode(tmp_path, tiny):
    """The engine's process loaded `load(model.name)`, the folder's base name, which is no model: exit 1."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(RANDOM["tiny-llama"].to_hf()))
    save_file({k: v.contiguous() for k, v in tiny.weights.items()}, str(folder / "model.safetensors"))
    shutil.copy(smollm2_folder() / "tokenizer.json", folder / "tokenizer.json")
    ids = [5, 17, 250, 3, 99]
    with serve_process("--model", str(folder), "--threads", "1", "--num-pages", "64") as (proc, port):
        status, body = call(port, "/v1/completions", dict(prompt=ids, max_tokens=6, return_token_ids=True))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stdout.read()
    assert status == 200 and body["model"] == "my-model", body
    assert body["choices"][0]["token_ids"] == ServingEngine(tiny, NUM_PAGES, PAGE_SIZE).generate([ids], 6)[0]


# ---- 4: the engine's process dies ----
def test_a_dead_engine_process_fails_requests_and_the_server_exits_nonzero():
    """Killed engine: the stream in flight ends with an error event and [DONE], the request that is not
    streamed gets a 5xx with OpenAI's error body, /health stops answering 200, and the server exits with
    code 1 (a supervisor restarts it). Before: /health stayed 200 and the stream never ended."""
    with serve_process("--model", "tiny-llama", "--threads", "1", "--num-pages", "128") as (proc, port):
        (engine,) = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        body = dict(prompt=[1, 2, 3], max_tokens=1500)      # 1,500 tokens: still decoding when killed
        whole = send(port, body)                              # sent first: in flight once the stream is
        streamed = send(port, body | dict(stream=True)).getresponse()
        first = streamed.readline()
        assert streamed.status == 200 and first.startswith(b"data: {")                 # its first token
        engine.kill()
        rest = (first + streamed.read()).decode().split("\n\n")
        assert rest[-2:] == ["data: [DONE]", ""], rest[-4:]
        error = json.loads(rest[-3].removeprefix("data: "))["error"]
        assert error["type"] == "server_error" and "engine's process ended" in error["message"], error
        resp = whole.getresponse()
        status, answer = resp.status, json.loads(resp.read())
        assert status >= 500 and answer["error"]["type"] == "server_error", (status, answer)
        assert health(port) != 200                            # 503, or nothing listens any more
        assert proc.wait(30) == 1
        assert "the engine's process ended" in proc.stdout.read()


def test_a_dead_engine_process_makes_health_503_and_refuses_requests():
    """The app served in this process over an EngineProcess whose process is killed (nothing stops the
    server here): /health and new requests answer 503 for good."""
    from lab.serve import EngineClient, EngineProcess

    client = EngineClient(EngineProcess("tiny-llama", NUM_PAGES, PAGE_SIZE, threads=1))
    client.start()
    try:
        with serving(client) as (port, _):
            assert call(port, "/health", method="GET") == (200, {"status": "ok"})
            client.engine.process.kill()
            wait_until(lambda: not client.alive, what="the engine's process to be seen dead")
            status, answer = call(port, "/health", method="GET")
            assert status == 503 and answer["error"]["code"] == "engine_failed", answer
            status, answer = call(port, "/v1/completions", dict(prompt=[1, 2], max_tokens=2))
            assert status == 503 and "exit code" in answer["error"]["message"], answer
    finally:
        client.stop()


# ---- 5: a client that leaves before a whole answer ----
def test_a_non_streaming_client_that_disconnects_is_cancelled(server):
    port, _, engine = server
    wait_until(lambda: not (engine.running or engine.waiting), what="an idle engine")
    baseline = engine.manager.num_free                              # group -> free pages
    conn = send(port, dict(prompt=[1, 2, 3, 4], max_tokens=1000))
    wait_until(lambda: engine.requests and len(engine.requests[max(engine.requests)].output) >= 3,
               what="the request to decode")
    rid = max(engine.requests)
    leave(conn)
    wait_until(lambda: engine.requests[rid].done, what="the request to end")
    assert engine.requests[rid].state == "cancelled" and len(engine.requests[rid].output) < 1000
    wait_until(lambda: engine.manager.num_free == baseline, what="its pages to be freed")


class Errors(logging.Handler):
    """The records of level ERROR and above that the server's loggers emit meanwhile."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        for name in ("uvicorn.error", "asyncio"):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in ("uvicorn.error", "asyncio"):
            logging.getLogger(name).removeHandler(self)


def test_a_non_streaming_client_that_disconnects_leaves_no_traceback(server):
    """Leaving before the whole answer is a client's right: the request is cancelled and nothing is logged as
    an error (the handler once read the result of the task it had just cancelled: InvalidStateError)."""
    port, _, engine = server
    wait_until(lambda: not (engine.running or engine.waiting), what="an idle engine")
    with Errors() as errors:
        for _ in range(3):
            conn = send(port, dict(prompt=[1, 2, 3, 4], max_tokens=1000))
            wait_until(lambda: engine.requests and len(engine.requests[max(engine.requests)].output) >= 3,
                       what="the request to decode")
            rid = max(engine.requests)
            leave(conn)
            wait_until(lambda: engine.requests[rid].done, what="the request to end")  # noqa: B023
        time.sleep(0.2)                                 # the handler's last lines run after the cancel
    assert not errors.records, [r.getMessage() for r in errors.records]


# ---- 6: one huge prompt stalls every other stream ----
class SlowBytes(ByteTokenizer):
    """The byte tokenizer, 1 s slower on a prompt that starts with "slow" (sleeping, as a long encode of a
    5 MB prompt runs in the tokenizer's native code)."""

    def encode(self, text: str) -> list[int]:
        if text.startswith("slow"):
            time.sleep(1.0)
        return super().encode(text)


class SlowSteps(ServingEngine):
    """A ServingEngine whose every step takes 1.2 ms more (sleeping, in the engine's thread), so that a stream
    of 1,800 tokens lasts 2 s at least on any machine."""

    def step(self):
        time.sleep(0.0012)
        return super().step()


def test_tokenizing_a_prompt_does_not_stall_other_streams(tiny):
    """A stream's tokens keep coming while another prompt is tokenized: no gap between two of its events
    reaches 0.5 s (a tiny-llama step takes milliseconds; tokenizing on the event loop made a gap of 1 s). The
    stream's 1,800 tokens take 2 s at least (SlowSteps), so it outlives the slow request (without that delay a
    fast machine finished the stream first, and the check had nothing to look at)."""
    model = dataclasses.replace(tiny, tokenizer=SlowBytes())
    with serving(SlowSteps(model, 128, PAGE_SIZE)) as (port, _):                      # 2,048 positions
        resp = send(port, dict(prompt=[1, 2, 3], max_tokens=1800, stream=True)).getresponse()
        resp.readline()
        times, started = [], threading.Event()

        def read():
            while line := resp.readline():
                if line.strip():
                    times.append(time.monotonic())
                    started.set()

        reader = threading.Thread(target=read)
        reader.start()
        started.wait(30)
        slow = ThreadPoolExecutor(1).submit(lambda: call(port, "/v1/completions", dict(prompt="slow down",
                                                                                       max_tokens=2)))
        assert slow.result(60)[0] == 200
        t_slow = time.monotonic()
        reader.join(60)
    assert times[-1] > t_slow                     # the stream outlived the slow request: a stall would show
    during = [b - a for a, b in itertools.pairwise(times) if b <= t_slow]
    assert max(during) < 0.5, max(during)


def raw_post(port, path: str, headers: dict, body: bytes) -> tuple[int, dict]:
    """POST with `Expect: 100-continue`, as curl sends a large body: the body goes only after the server's
    100 Continue; a server that refuses first answers without reading it. (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        s.sendall(head.encode())
        f = s.makefile("rb")
        status_line = f.readline()
        if b" 100 " in status_line:
            f.readline()                                          # the blank line after 100 Continue
            s.sendall(body)
            status_line = f.readline()
        resp_headers = {}
        while (line := f.readline().decode().strip()):
            k, v = line.split(":", 1)
            resp_headers[k.lower()] = v.strip()
        data = f.read(int(resp_headers["content-length"]))
        return int(status_line.split()[1]), json.loads(data)


def test_a_body_over_the_limit_is_refused_with_413(server, tiny):
    """A 10 MB body is refused by its Content-Length, unread (it got a 200 when its prompt fit); a chunked
    body, which has none, as soon as it is over the limit."""
    port = server[0]
    body = json.dumps(dict(prompt="a" * 10_000_000, max_tokens=2)).encode()   # 10 MB
    status, answer = raw_post(port, "/v1/completions", {"Content-Type": "application/json",
                                                        "Content-Length": len(body)}, body)
    assert_openai_error(status, answer, 413)
    from lab.serve import MAX_BODY_BYTES

    assert f"{MAX_BODY_BYTES:,}" in answer["error"]["message"]
    with serving(ServingEngine(tiny, NUM_PAGES, PAGE_SIZE), max_body_bytes=1000) as (small, _):
        chunked = json.dumps(dict(prompt=[1] * 500)).encode()                 # 1,512 bytes, no Content-Length
        with socket.create_connection(("127.0.0.1", small), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + b"%x\r\n" % len(chunked) + chunked + b"\r\n0\r\n\r\n")
            status_line = s.makefile("rb").readline()
        assert b" 413 " in status_line, status_line
        assert call(small, "/v1/completions", dict(prompt=[1] * 300, max_tokens=2))[0] == 200   # 913 bytes


# ---- 7: ids and JSON the server cannot hold ----
@pytest.mark.parametrize("prompt", [[1, 2**63], [2**64, 1]], ids=["2**63", "2**64"])
def test_a_prompt_id_outside_the_vocabulary_is_400(server, prompt):
    status, answer = call(server[0], "/v1/completions", dict(prompt=prompt, max_tokens=2))
    assert_openai_error(status, answer, 400, param="prompt")
    assert "vocabulary" in answer["error"]["message"], answer


@pytest.mark.parametrize("body", [b"[" * 50_000 + b"]" * 50_000,
                                  b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"], ids=["top", "prompt"])
def test_a_deeply_nested_body_is_400(server, body):
    status, answer = call(server[0], "/v1/completions", body)
    assert_openai_error(status, answer, 400)
    assert "nested too deeply" in answer["error"]["message"], answer


# ---- 10: top_p ----
@pytest.mark.parametrize("top_p", [0, -0.5, 1.5])
def test_top_p_outside_zero_one_is_400(server, top_p):
    status, answer = call(server[0], "/v1/completions", dict(prompt=[1, 2], max_tokens=2, top_p=top_p))
    assert_openai_error(status, answer, 400, param="top_p")


# ---- 11: request ids that are not ints ----
def test_cancel_with_a_bool_or_float_id_is_a_type_error(server):
    """`cancel(True)` and `cancel(2.0)` cancelled requests 1 and 2 (True == 1, 2.0 == 2 as dict keys)."""
    port, app, engine = server
    wait_until(lambda: not (engine.running or engine.waiting), what="an idle engine")
    conns = [send(port, dict(prompt=[1, 2, 3], max_tokens=1000, stream=True)) for _ in range(3)]
    wait_until(lambda: sum(r.state == "running" for r in engine.requests.values()) == 3, what="3 running")
    running = sorted(r.id for r in engine.requests.values() if r.state == "running")
    for bad in (True, float(running[1]), str(running[2])):
        with pytest.raises(TypeError, match="int"):
            app.state.loop.cancel(bad)
    time.sleep(0.1)
    assert all(engine.requests[rid].state == "running" for rid in running)
    for conn in conns:
        leave(conn)
    wait_until(lambda: not (engine.running or engine.waiting), what="an idle engine")


HEALTHY = """import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

PARENT = """import sys, time
from lab.serve.process import free_port, server_process
port = free_port()
with server_process([sys.executable, "-c", sys.argv[1], str(port)], {}, port, 30) as (proc, url):
    print(proc.pid, flush=True)
    time.sleep(60)
"""


def test_a_script_stopped_with_sigterm_stops_its_servers():
    """A server runs in a session of its own, so it outlives a script that started it and was stopped with `kill`
    (SIGTERM), unless the script stops it on the way out (four lab servers and two vLLM ones outlived an
    experiment so stopped): server_process turns SIGTERM into SystemExit while it runs, and its `finally` stops
    the server before the script exits."""
    root = Path(__file__).resolve().parents[1]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, HEALTHY], stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"PYTHONPATH": str(root)})
    child = int(parent.stdout.readline())
    try:
        assert psutil.pid_exists(child)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 128 + signal.SIGTERM      # SystemExit(143): it exited through its finally blocks
        assert not psutil.pid_exists(child)
    finally:
        parent.kill()
        if psutil.pid_exists(child):
            psutil.Process(child).kill()
