"""`python -m lab.serve`: the OpenAI-compatible server over the ServingEngine, spoken to over real HTTP.

Oracle: the same prompt ids through a fresh ServingEngine's `generate` (itself checked token for token
against each request decoded alone, tests/test_serving.py), and for text the tokenizer's decoding of all
the ids at once. Tolerance: none, the tokens and the text must be equal. The server runs in this process
(uvicorn in a thread, on a free port of 127.0.0.1) so a test can look at its engine's pool; the engine in
a process of its own (EngineProcess, what `python -m lab.serve` runs) is looked at through its
snapshots; one test starts `python -m lab.serve` as a process and stops it with SIGTERM. Defects found
and fixed have their regression tests in tests/test_defects_serve.py.
"""

import argparse
import dataclasses
import http.client
import importlib
import json
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given
from hypothesis import strategies as st
from servers import call, serve_process, serving

from lab.engine import ChatSession, PrefixCachingBackend, ServingEngine, beam_search
from lab.models import load
from lab.models.load import RANDOM, smollm2_folder
from lab.models.tokenizer import ByteTokenizer, Tokenizer
from lab.serve import EngineClient, EngineProcess, EngineThread, IncrementalDetokenizer, RequestIdError

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


def events(port, path, body) -> list:
    """The server-sent events of a streamed request: each `data:` payload, parsed, then "[DONE]"."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps(body | {"stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    out = []
    for line in resp.read().decode().split("\n\n"):
        if line:
            assert line.startswith("data: ")
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    conn.close()
    return out


def greedy(model, prompt, n) -> list:
    """The oracle: `prompt`'s greedy tokens through a fresh engine of its own."""
    return ServingEngine(model, NUM_PAGES, PAGE_SIZE).generate([prompt], n)[0]


def prompts(lengths, seed=0, vocab=320) -> list[list]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def wait_idle(engine, timeout=10):
    """Wait until the engine's thread has no request left (it may still be finishing a step)."""
    deadline = time.monotonic() + timeout
    while engine.running or engine.waiting:
        assert time.monotonic() < deadline, f"the engine did not go idle: {engine!r}"
        time.sleep(0.01)


# ---- answers ----
def test_completion_tokens_equal_the_engine(server, tiny):
    port, _, engine = server
    (ids,) = prompts([21], seed=1)
    status, body = call(port, "/v1/completions", dict(prompt=ids, max_tokens=12, return_token_ids=True))
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == "tiny-llama" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["token_ids"] == greedy(tiny, ids, 12) and choice["prompt_token_ids"] == ids
    assert choice["text"] == tiny.tokenizer.decode(choice["token_ids"]) and choice["finish_reason"] == "length"
    assert body["usage"] == dict(prompt_tokens=21, completion_tokens=12, total_tokens=33)
    status, body = call(port, "/v1/completions", dict(prompt="The cache", max_tokens=5, return_token_ids=True))
    assert status == 200 and body["choices"][0]["prompt_token_ids"] == list(b"The cache")  # bytes: ByteTokenizer
    assert body["choices"][0]["token_ids"] == greedy(tiny, list(b"The cache"), 5)
    wait_idle(engine)
    assert engine.manager.num_free == engine.manager.num_pages


def test_streaming_gives_what_one_response_gives(server):
    port = server[0]
    request = dict(prompt=prompts([9], seed=2)[0], max_tokens=10, return_token_ids=True)
    whole = call(port, "/v1/completions", request)[1]
    chunks = events(port, "/v1/completions", request | dict(stream_options=dict(include_usage=True)))
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == [] and chunks[-2]["usage"] == whole["usage"]
    tokens = chunks[:-2]
    assert len(tokens) == 10 and all(c["object"] == "text_completion" and c["id"] == tokens[0]["id"] for c in tokens)
    assert [t for c in tokens for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in tokens) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 9 + ["length"]
    assert "usage" not in events(port, "/v1/completions", request)[-2]      # usage only when asked for


def test_eos_stops_a_request_and_is_not_in_its_text(tiny):
    ids = prompts([7], seed=3)[0]
    free = greedy(tiny, ids, 8)
    eos = free[4]
    assert eos not in free[:4]                                              # its first occurrence: the 5th
    with serving(ServingEngine(tiny, NUM_PAGES, PAGE_SIZE), eos_id=eos) as (port, _):
        status, body = call(port, "/v1/completions", dict(prompt=ids, max_tokens=8, return_token_ids=True))
        chunks = events(port, "/v1/completions", dict(prompt=ids, max_tokens=8))
    (choice,) = body["choices"]
    assert status == 200 and choice["finish_reason"] == "stop" and choice["token_ids"] == free[:5]
    assert choice["text"] == tiny.tokenizer.decode(free[:4]) and body["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and len(chunks) == 6


class TemplateBytes(ByteTokenizer):
    """The byte tokenizer with a chat template: `role: content` lines, then `assistant:`."""

    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def test_chat_renders_the_template_and_decodes_like_the_engine(tiny):
    model = dataclasses.replace(tiny, tokenizer=TemplateBytes())
    messages = [dict(role="system", content="Be brief."), dict(role="user", content="Hi")]
    ids = list(TemplateBytes().apply_chat_template(messages).encode())
    with serving(ServingEngine(model, NUM_PAGES, PAGE_SIZE)) as (port, _):
        request = dict(messages=messages, max_tokens=6, return_token_ids=True)
        status, body = call(port, "/v1/chat/completions", request)
        chunks = events(port, "/v1/chat/completions", request)
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == greedy(tiny, ids, 6)
    assert choice["message"] == dict(role="assistant", content=TemplateBytes().decode(choice["token_ids"]))
    assert choice["finish_reason"] == "length" and body["usage"]["prompt_tokens"] == len(ids)
    assert chunks[-1] == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == choice["message"]["content"]


def test_smollm2_chat_says_what_a_chat_session_says(smollm2):
    """The real model and its template: the reply (stopped by its eos token) equals ChatSession's, which
    decodes alone on a PrefixCachingBackend (tests/test_chat.py checks that against recomputation)."""
    question = [dict(role="user", content="What is the capital of France?")]
    session = ChatSession(smollm2, PrefixCachingBackend(smollm2, 64, PAGE_SIZE), max_new_tokens=12)
    with serving(ServingEngine(smollm2, NUM_PAGES, PAGE_SIZE)) as (port, _):
        status, body = call(port, "/v1/chat/completions", dict(messages=question, max_tokens=12))
    (choice,) = body["choices"]
    assert status == 200 and choice["message"]["content"] == session.say(question[0]["content"])
    assert choice["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == session.turns[0]["reply_tokens"]


def test_models_and_health(server):
    port = server[0]
    status, body = call(port, "/v1/models", method="GET")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny-llama"] and body["object"] == "list"
    assert call(port, "/health", method="GET") == (200, {"status": "ok"})


# ---- text, token by token ----
MULTI_BYTE = "aé€😀日本 \n"                      # 1, 2, 3 and 4 bytes in UTF-8, a space, a newline


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return Tokenizer.from_folder(smollm2_folder())


def detokenize(tokenizer, ids, cuts) -> str:
    """The concatenated text an IncrementalDetokenizer gives for `ids` fed in pieces cut at `cuts`, then
    flushed."""
    d, at, out = IncrementalDetokenizer(tokenizer), 0, []
    for cut in sorted(cuts) + [len(ids)]:
        out.append(d.add(ids[at:cut]))
        at = cut
    return "".join(out) + d.flush()


@pytest.mark.parametrize("which", ["bytes", "smollm2"])
@given(data=st.data())
def test_incremental_detokenizing_equals_decoding_all_ids(which, data, smollm2_tokenizer):
    """The oracle: `tokenizer.decode(all ids)`, for random ids (any byte, half characters, special tokens)
    and for the ids of random text with multi-byte characters, fed one id or a few at a time."""
    tok = ByteTokenizer() if which == "bytes" else smollm2_tokenizer
    if data.draw(st.booleans(), label="from text"):
        ids = tok.encode(data.draw(st.text(MULTI_BYTE, min_size=1, max_size=30), label="text"))
    else:
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=40), label="ids")
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)), label="cuts")
    assert detokenize(tok, ids, cuts) == tok.decode(ids)
    assert detokenize(tok, ids, range(len(ids))) == tok.decode(ids)        # one id at a time, as served


class CountingBytes(ByteTokenizer):
    """The byte tokenizer, counting the ids it decodes."""

    decoded = 0

    def decode(self, ids) -> str:
        self.decoded += len(ids)
        return super().decode(ids)


def test_incremental_detokenizing_decodes_a_short_window():
    """2,000 ids one at a time: decoding everything at every id would decode n(n+1)/2 = 2,001,000 ids. The
    window is the last shown piece plus the held-back ids (at most 3 bytes of a character here), decoded
    twice per id: under 20 ids per id."""
    tok = CountingBytes()
    ids = tok.encode(MULTI_BYTE * 200)[:2000]
    assert len(ids) == 2000
    assert detokenize(tok, ids, range(len(ids))) == ByteTokenizer().decode(ids)
    assert tok.decoded < 20 * len(ids), tok.decoded


# ---- many at once ----
def test_concurrent_requests_complete_and_are_batched(server, tiny):
    port, _, engine = server
    ps, n = prompts((5, 30, 12, 1, 44, 17), seed=4), 60
    before = len(engine.stats["batch_sizes"])
    with ThreadPoolExecutor(len(ps)) as pool:
        answers = list(pool.map(lambda p: call(port, "/v1/completions",
                                               dict(prompt=p, max_tokens=n, return_token_ids=True)), ps))
    assert [a[1]["choices"][0]["token_ids"] for a in answers] == [greedy(tiny, p, n) for p in ps]
    assert max(engine.stats["batch_sizes"][before:]) > 1                      # decoded together, not in turn
    wait_idle(engine)
    assert engine.manager.num_free == engine.manager.num_pages


# ---- errors ----
P = [1, 2, 3]
BAD = [  # (path, body, status, param, code, words in the message)
    ("/v1/completions", b"{not json", 400, None, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, None, "dictionary"),
    ("/v1/completions", {}, 400, "prompt", None, "Field required"),
    ("/v1/completions", dict(prompt=P, max_tokens=0), 400, "max_tokens", None, "greater than or equal to 1"),
    ("/v1/completions", dict(prompt=P, max_tokens="5"), 400, "max_tokens", None, "valid integer"),
    ("/v1/completions", dict(prompt=P, best_of=2, logit_bias={}), 400, "best_of", None, "best_of, logit_bias"),
    ("/v1/completions", dict(prompt=P, temperature=-0.5), 400, "temperature", None, "greater than or equal to 0"),
    ("/v1/completions", dict(prompt=P, temperature=0.7, top_p=0.9), 400, "top_p", None, "top_p must be 1"),
    ("/v1/completions", dict(prompt=P, n=0), 400, "n", None, "greater than or equal to 1"),
    ("/v1/completions", dict(prompt=P, n=-2), 400, "n", None, "greater than or equal to 1"),
    ("/v1/completions", dict(prompt=P, n=True), 400, "n", None, "valid integer"),
    ("/v1/completions", dict(prompt=P, n=129), 400, "n", None, "less than or equal to 128"),
    ("/v1/completions", dict(prompt=[1] * 100, max_tokens=200, n=6), 400, "prompt", "exceeds_kv_pool", "6 answers"),
    ("/v1/completions", dict(prompt=P, seed=-1), 400, "seed", None, "greater than or equal to 0"),
    ("/v1/completions", dict(prompt=P, stop="\n"), 400, "stop", None, "stop sequences"),
    ("/v1/completions", dict(prompt=[]), 400, "prompt", None, "empty"),
    ("/v1/completions", dict(prompt=[1, 320]), 400, "prompt", None, "320"),
    ("/v1/completions", dict(prompt=[1] * 2000, max_tokens=100), 400, "prompt", "context_length_exceeded", "2048"),
    ("/v1/completions", dict(prompt=[1] * 100, max_tokens=1000), 400, "prompt", "exceeds_kv_pool", "64"),
    ("/v1/completions", dict(prompt=P, model="gpt-4o"), 404, "model", "model_not_found", "gpt-4o"),
    ("/v1/chat/completions", dict(messages=[]), 400, "messages", None, "at least 1"),
    ("/v1/chat/completions", dict(messages=[dict(role="user", content="hi")]), 400, "messages", None,
     "no chat template"),
    ("/v1/chat/completions", dict(messages=[dict(role="robot", content="hi")]), 400, "messages", None,
     "messages.0.role"),
    ("/v1/nothing", {}, 404, None, None, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,param,code,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_request_is_refused_and_changes_nothing(server, path, body, status, param, code, words):
    port, _, engine = server
    wait_idle(engine)
    free, count = engine.manager.num_free, len(engine.requests)
    got, answer = call(port, path, body)
    error = answer["error"]
    assert got == status and set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code) and words in error["message"], error
    assert engine.manager.num_free == free and len(engine.requests) == count  # not even queued


def test_the_wrong_method_is_405_and_common_fields_are_accepted(server):
    port = server[0]
    status, answer = call(port, "/v1/completions", method="GET")
    assert status == 405 and answer["error"]["message"] == "Method Not Allowed"
    request = dict(prompt=P, max_tokens=2, model="tiny-llama", n=1, user="me", stop=None, temperature=0,
                   top_p=1.0, seed=7)
    status, answer = call(port, "/v1/completions", request)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


# ---- n choices ----
def test_n_choices_share_one_prefill_and_count_the_prompt_once(server, tiny):
    """n = 3 greedy choices: three equal answers, each the prompt's alone, indices 0..2, each with its
    finish_reason, the prompt counted once in the usage; sampled choices with a seed are repeatable and
    differ from one another; streamed, every chunk names its choice and each choice ends once."""
    port, _, engine = server
    p = prompts([12], seed=6)[0]
    status, answer = call(port, "/v1/completions", dict(prompt=p, max_tokens=5, n=3, return_token_ids=True))
    assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == greedy(tiny, p, 5) and c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"] == dict(prompt_tokens=12, completion_tokens=15, total_tokens=27)
    body = dict(prompt=p, max_tokens=6, n=4, temperature=0.9, seed=3, return_token_ids=True)
    first, again = (call(port, "/v1/completions", body)[1]["choices"] for _ in range(2))
    assert [c["token_ids"] for c in first] == [c["token_ids"] for c in again]
    assert len({tuple(c["token_ids"]) for c in first}) > 1
    chunks = events(port, "/v1/completions", body)
    assert chunks[-1] == "[DONE]"
    by_index = {}
    for chunk in chunks[:-1]:
        choice, = chunk["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert [[t for c in by_index[i] for t in c["token_ids"]] for i in range(4)] == [c["token_ids"] for c in first]
    assert all([c["finish_reason"] for c in by_index[i]].count("length") == 1 for i in range(4))
    wait_idle(engine)
    assert engine.manager.num_free == engine.manager.num_pages


def test_beam_search_over_http_answers_as_the_library(server, tiny):
    """use_beam_search with n = 3: the choices are beam_search's three hypotheses, best first, in their order;
    sampling or streaming with it is refused, as is a bad length_penalty."""
    port, _, engine = server
    p = prompts([9], seed=7)[0]
    body = dict(prompt=p, max_tokens=6, n=3, use_beam_search=True, length_penalty=0.5, return_token_ids=True)
    status, answer = call(port, "/v1/completions", body)
    want = beam_search(tiny, p, 3, 6, length_penalty=0.5, page_size=PAGE_SIZE).sequences
    assert status == 200 and [c["token_ids"] for c in answer["choices"]] == want
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and answer["usage"]["completion_tokens"] == 18
    for bad, param in ((dict(temperature=0.5), "temperature"), (dict(stream=True), "stream"),
                       (dict(length_penalty=99.0), "length_penalty")):
        status, answer = call(port, "/v1/completions", body | bad)
        assert status == 400 and answer["error"]["param"] == param, answer
    wait_idle(engine)
    assert engine.manager.num_free == engine.manager.num_pages


def test_n_chat_choices_each_open_with_the_role(tiny):
    """Chat with n = 2, sampled without a seed: two messages; streamed, each choice's first delta (and only
    it) carries the role, and its deltas make its message."""
    model = dataclasses.replace(tiny, tokenizer=TemplateBytes())
    request = dict(messages=[dict(role="user", content="Hi")], max_tokens=5, n=2, temperature=0.8)
    with serving(ServingEngine(model, NUM_PAGES, PAGE_SIZE)) as (port, _):
        status, body = call(port, "/v1/chat/completions", request)
        chunks = events(port, "/v1/chat/completions", request)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 10
    for i in range(2):
        deltas = [c["choices"][0]["delta"] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:]) and len(deltas) == 5


def test_a_failing_engine_answers_500_and_hangs_nothing(server, monkeypatch):
    port, _, engine = server
    wait_idle(engine)

    def broken():
        raise RuntimeError("a bug in step")

    monkeypatch.setattr(engine, "step", broken)
    status, answer = call(port, "/v1/completions", dict(prompt=P, max_tokens=2))
    assert status == 500 and answer["error"]["type"] == "server_error" and "a bug in step" in answer["error"]["message"]
    *_, error, done = events(port, "/v1/completions", dict(prompt=P, max_tokens=2))   # streamed: an error event
    assert done == "[DONE]" and "a bug in step" in error["error"]["message"], error
    monkeypatch.undo()
    assert engine.requests[max(engine.requests)].state == "cancelled" and not engine.waiting
    assert call(port, "/v1/completions", dict(prompt=P, max_tokens=2))[0] == 200   # the thread lives on


# ---- a client that goes away, a server that stops ----
def stream_three_tokens(port, seed):
    """A streamed request of 20 + 900 tokens (58 of the 64 pages), read until its third token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = dict(prompt=prompts([20], seed=seed)[0], max_tokens=900, stream=True)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    for _ in range(6):                                        # three tokens' events and their blank lines
        resp.readline()
    return conn


def leave(conn):
    """The client goes away mid-stream."""
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
    port, _, engine = server
    wait_idle(engine)
    baseline = engine.manager.num_free["full"]
    conn = stream_three_tokens(port, seed=5)
    rid = max(engine.requests)
    assert engine.requests[rid].state == "running" and engine.manager.num_free["full"] < baseline
    leave(conn)
    wait_idle(engine)
    assert engine.requests[rid].state == "cancelled" and len(engine.requests[rid].output) < 900
    assert engine.manager.num_free["full"] == baseline


def test_a_draining_server_refuses_new_requests(server):
    port, app, engine = server
    app.state.draining = True
    try:
        status, answer = call(port, "/v1/completions", dict(prompt=P, max_tokens=2))
        assert status == 503 and answer["error"]["code"] == "shutting_down"
        assert call(port, "/health", method="GET")[0] == 503
    finally:
        app.state.draining = False
    assert call(port, "/v1/completions", dict(prompt=P, max_tokens=2))[0] == 200


# ---- the engine in a process of its own ----
@pytest.fixture(scope="module")
def remote(tiny):
    client = EngineClient(EngineProcess("tiny-llama", NUM_PAGES, PAGE_SIZE, max_batch_tokens=64, threads=1,
                                        fast_decode="measure"))     # as `python -m lab.serve` starts it
    client.start()
    try:
        with serving(client) as (port, app):
            yield port, client
    finally:
        client.stop()
    assert not client.engine.process.is_alive()


def wait_idle_remote(engine, timeout=10) -> dict:
    deadline = time.monotonic() + timeout
    while (snap := engine.snapshot())["in_flight"]:
        assert time.monotonic() < deadline, f"the engine's process did not go idle: {snap}"
        time.sleep(0.01)
    return snap


def test_the_engine_process_reports_its_measured_fused_step(remote):
    from lab.serve.cli import fast_decode_arg, fused_line

    fast = remote[1].engine.fast
    assert 0 <= fast["rows"] <= 16 and sorted(fast["timings"])[0] == 1
    assert fused_line(remote[1].engine).startswith(f"fused decode steps of up to {fast['rows']} sequences (measured")
    assert [fast_decode_arg(t) for t in ("measure", "off", "0", "16")] == ["measure", False, 0, 16]
    thread = EngineThread(ServingEngine(load("tiny-llama"), NUM_PAGES, PAGE_SIZE, fast_decode=0))
    assert fused_line(thread) == "every step through forward_cached (--fast-decode 0)"
    thread.engine.fast.timings = {1: dict(fused=2.0, reference=1.0)}     # as a tune that found it slower leaves it
    assert fused_line(thread).endswith("(measured: the fused step was slower at every size)")
    for bad in ("17", "-1", "on", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="measure, off or a number"):
            fast_decode_arg(bad)


def test_an_engine_process_answers_what_the_engine_computes(remote, tiny):
    port, engine = remote
    ps = prompts([5, 17, 33, 40, 9, 26], seed=11)
    bodies = [dict(prompt=p, max_tokens=8 + i, return_token_ids=True) for i, p in enumerate(ps)]
    with ThreadPoolExecutor(len(ps)) as pool:                 # at once: batched in the engine's process
        answers = list(pool.map(lambda b: call(port, "/v1/completions", b), bodies))
    want = ServingEngine(tiny, NUM_PAGES, PAGE_SIZE).generate(ps, [8 + i for i in range(len(ps))])
    assert [a[1]["choices"][0]["token_ids"] for a in answers] == want and {a[0] for a in answers} == {200}
    streamed = events(port, "/v1/completions", bodies[2])
    assert [t for e in streamed[:-1] for t in e["choices"][0]["token_ids"]] == want[2]
    status, error = call(port, "/v1/completions", dict(prompt=[1] * 2048, max_tokens=4))
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"   # refused in the child
    beams = dict(prompt=ps[0], max_tokens=5, n=2, use_beam_search=True, return_token_ids=True)
    status, answer = call(port, "/v1/completions", beams)                  # searched in the child
    assert [c["token_ids"] for c in answer["choices"]] == beam_search(tiny, ps[0], 2, 5, page_size=PAGE_SIZE).sequences
    status, error = call(port, "/v1/completions", beams | dict(prompt=[1] * 2046))
    assert status == 400 and error["error"]["param"] == "prompt"           # the child's InputError, over the pipe
    snap = wait_idle_remote(engine)
    assert snap["free_pages"] == {"full": NUM_PAGES} and max(snap["batch_sizes"]) > 1


def test_an_engine_process_in_bfloat16_answers_what_a_bfloat16_engine_computes():
    """Regression: `python -m lab.serve` always loaded float32. With --dtype bfloat16 the engine's process
    loads the model in bfloat16 (the server's side reads the same dtype into its config) and answers what
    an engine over `load("tiny-llama", dtype="bfloat16")` computes."""
    engine = EngineClient(EngineProcess("tiny-llama", NUM_PAGES, PAGE_SIZE, max_batch_tokens=64, threads=1,
                                        dtype="bfloat16"))
    ps = prompts([5, 17, 9], seed=12)
    engine.start()
    try:
        with serving(engine) as (port, app):
            answers = [call(port, "/v1/completions", dict(prompt=p, max_tokens=6, return_token_ids=True)) for p in ps]
    finally:
        engine.stop()
    want = ServingEngine(load("tiny-llama", dtype="bfloat16"), NUM_PAGES, PAGE_SIZE).generate(ps, 6)
    assert engine.config.dtype == "bfloat16"
    assert [a[1]["choices"][0]["token_ids"] for a in answers] == want


def test_an_engine_process_frees_the_pages_of_a_client_that_leaves(remote):
    port, engine = remote
    before = wait_idle_remote(engine)
    baseline = before["free_pages"]["full"]                 # group -> free pages
    conn = stream_three_tokens(port, seed=6)
    assert engine.snapshot()["free_pages"]["full"] < baseline
    leave(conn)
    snap = wait_idle_remote(engine)
    assert snap["free_pages"]["full"] == baseline and snap["computed_tokens"] - before["computed_tokens"] < 20 + 900


def test_an_engine_process_loads_no_weights_in_the_server(monkeypatch, smollm2):
    """The server's side takes the config and tokenizer from the folder (or the random model's table);
    only the engine's process loads weights. Oracle: what `load` gives."""
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded in the server's process")

    module = importlib.import_module("lab.models.load")       # `lab.models.load` is the function
    monkeypatch.setattr(module, "load_folder", no_weights)
    monkeypatch.setattr(module, "random_model", no_weights)
    folder = smollm2_folder()
    engine = EngineProcess(str(folder), NUM_PAGES, PAGE_SIZE)
    assert engine.config == dataclasses.replace(smollm2.config, name=folder.name) and engine.name == folder.name
    assert engine.tokenizer.sha256 == smollm2.tokenizer.sha256
    tiny = EngineProcess("tiny-llama", NUM_PAGES, PAGE_SIZE)
    assert tiny.config == RANDOM["tiny-llama"] and isinstance(tiny.tokenizer, ByteTokenizer)
    assert not engine.process.is_alive() and not tiny.process.is_alive()   # not started: nothing loaded


def test_an_engine_process_refuses_an_id_that_is_not_an_int(remote):
    port, engine = remote
    for bad in (True, 2.0, "1"):
        with pytest.raises(RequestIdError, match="int"):
            engine.cancel(bad)
    assert call(port, "/v1/completions", dict(prompt=[1, 2], max_tokens=2))[0] == 200


@pytest.mark.slow            # over 5 s: make test within 15 minutes (make test-slow runs it)
def test_sigterm_finishes_the_stream_in_flight_then_exits_cleanly():
    """`python -m lab.serve` as a process: SIGTERM while a stream runs lets it finish, then exit code 0."""
    with serve_process("--model", "tiny-llama", "--threads", "1", "--num-pages", "128") as (proc, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = dict(prompt=[1, 2, 3], max_tokens=1000, stream=True)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()
        proc.send_signal(signal.SIGTERM)                       # while 999 tokens are still to come
        rest = (first + resp.read()).decode().split("\n\n")
        assert rest[-2:] == ["data: [DONE]", ""] and len(rest) == 1000 + 2      # every token, then [DONE]
        assert json.loads(rest[-3][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
        log = proc.stdout.read()
        assert "Waiting for connections to close" in log, log      # the stream was still running at SIGTERM
        assert "Finished server process" in log, log
