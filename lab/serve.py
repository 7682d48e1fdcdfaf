"""`python -m lab.serve`: an OpenAI-compatible HTTP server over the ServingEngine (chapter 8).

The engine runs in a process of its own (`EngineProcess`), as vLLM runs its engine core apart from its
API server: the process loads the model, takes new requests and cancellations from a pipe, steps the
engine while any request waits or runs, and sends each step's new tokens back in one message. This
process serves HTTP: the handlers check a request, send it to the engine and await its tokens, which a
reader thread hands to their asyncio queues. Whatever arrives while others decode joins the next step's
batch (continuous batching). A client that goes away mid-stream has its request cancelled, which frees
its pages. On SIGINT or SIGTERM the server refuses new requests (503), lets the admitted ones finish,
then stops the engine and exits.

`--one-process` keeps the engine in this process instead: `EngineLoop` steps it in the main thread and
HTTP is served from a second thread (what `create_app` does by default, on a thread of its own, for an
app served inside another program, as the tests do). Then the two share one interpreter lock; chapter 8
measures the server both ways.

    python -m lab.serve --model smollm2 --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'

Decoding is greedy, so `temperature` must be 0 or absent. `return_token_ids: true` adds the token ids to
each choice (`prompt_token_ids`, `token_ids`), as vLLM does.
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import queue
import signal
import threading
import time
import uuid
from typing import Literal

import jinja2
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from .cache import OutOfPagesError
from .engine import ServingEngine
from .models import InputError, PositionLimitError, load

# ---- the engine's thread ----


class EngineLoop:
    """The one thread that touches a ServingEngine: it adds, cancels and steps, in that order, round after
    round; it sleeps while the engine has nothing to do."""

    def __init__(self, engine: ServingEngine):
        self.engine = engine
        self.inbox = queue.SimpleQueue()   # ("add", ...), ("cancel", rid) and ("stop",), from the event loop
        self.streams = {}                  # request id -> (event loop, asyncio.Queue of (token, finish_reason))
        self.thread = None                 # when it runs on a thread of its own (`start`)

    def start(self):
        """Run on a thread of its own (an app served inside another program: the tests); `main` calls `run`
        in the main thread instead."""
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.thread.start()

    def stop(self):
        """Cancel whatever is left and end `run` (and wait for its thread, if it has one)."""
        self.inbox.put(("stop",))
        if self.thread is not None:
            self.thread.join()

    async def add(self, ids, max_new_tokens: int, eos_id: int | None) -> tuple[int, asyncio.Queue]:
        """Queue a request; its id and the queue its (token, finish_reason) pairs arrive on. Raises what
        `add_request` raises: a bad request changes nothing."""
        loop = asyncio.get_running_loop()
        admitted, tokens = loop.create_future(), asyncio.Queue()
        self.inbox.put(("add", ids, max_new_tokens, eos_id, loop, admitted, tokens))
        return await admitted, tokens

    def cancel(self, rid: int):
        self.inbox.put(("cancel", rid))

    def run(self):
        while True:
            messages = self._receive(wait=not (self.engine.running or self.engine.waiting))  # idle: sleep
            try:
                for kind, *args in messages:
                    if kind == "stop":
                        self._stopped()
                        return
                    self._handle(kind, *args)
                if self.engine.running or self.engine.waiting:
                    self._step()
            except Exception as e:                                 # a bug: every request fails (500), none hangs
                self._fail(e)

    def _receive(self, wait: bool) -> list:
        """Every message in the inbox; with `wait`, block until there is one."""
        messages = [self.inbox.get()] if wait else []
        with contextlib.suppress(queue.Empty):
            while True:
                messages.append(self.inbox.get_nowait())
        return messages

    def _handle(self, kind, *args):
        if kind == "cancel":
            self.streams.pop(args[0], None)
            self.engine.cancel(args[0])                             # False if it had finished: fine
        else:
            self._add(*args)

    def _add(self, ids, max_new_tokens, eos_id, loop, admitted, tokens):
        try:
            rid = self.engine.add_request(ids, max_new_tokens, eos_id)
        except Exception as e:                                     # a bad request: the engine is unchanged
            loop.call_soon_threadsafe(settle, self, admitted, None, e)
            return
        self.streams[rid] = (loop, tokens)
        loop.call_soon_threadsafe(settle, self, admitted, rid, None)

    def _step(self):
        for rid, token, finish in finished_tokens(self.engine, self.engine.step()):
            if rid in self.streams:
                loop, tokens = self.streams.pop(rid) if finish else self.streams[rid]
                loop.call_soon_threadsafe(tokens.put_nowait, (token, finish))

    def _stopped(self):
        self._fail(RuntimeError("the server stopped"))

    def _fail(self, error: Exception):
        """Hand `error` to every request still waiting for tokens, and drop them from the engine."""
        for rid, (loop, tokens) in self.streams.items():
            with contextlib.suppress(Exception):
                self.engine.cancel(rid)
            loop.call_soon_threadsafe(tokens.put_nowait, error)
        self.streams.clear()


def finished_tokens(engine, new: dict) -> list:
    """(request id, token, finish_reason) for one step's new tokens: None while a request runs, "stop" at
    its eos token, "length" at its max_tokens."""
    out = []
    for rid, token in new.items():
        req = engine.requests[rid]
        out.append((rid, token, None if req.state != "finished" else "stop" if token == req.eos_id else "length"))
    return out


def settle(engine_loop, admitted, rid, error):
    """On the event loop: answer the handler waiting in `add`, or cancel if it stopped waiting."""
    if admitted.cancelled():                                       # the client left before its request was in
        if rid is not None:
            engine_loop.cancel(rid)
    elif error is not None:
        admitted.set_exception(error)
    else:
        admitted.set_result(rid)


# ---- the engine in a process of its own ----


class EngineProcess:
    """A ServingEngine stepped in a process of its own, as vLLM runs its engine core apart from its API
    server: the server's Python (parsing, detokenizing, writing events) and the engine's Python between
    torch calls then never wait for each other's interpreter lock (chapter 8 measures the difference).

    The same add / cancel / start / stop as EngineLoop, for `create_app(..., loop=...)`. Requests and
    cancellations go to the engine over a pipe; each step's new tokens come back in one message, and a
    thread of this process hands them to their requests' queues. `model` (loaded here for its tokenizer
    and config), `page_size` and `num_pages` describe the engine to the app; the child loads its own copy
    of the model by name.
    """

    def __init__(self, model, num_pages: int, page_size: int = 16, max_batch_tokens: int = 256,
                 prefix_caching: bool = True, threads: int | None = None):
        self.model, self.page_size, self.num_pages = model, page_size, num_pages
        ctx = multiprocessing.get_context("spawn")        # a fresh interpreter: no forked torch thread pools
        self.conn, child = ctx.Pipe()
        engine_args = dict(num_pages=num_pages, page_size=page_size, max_batch_tokens=max_batch_tokens,
                           prefix_caching=prefix_caching)
        self.process = ctx.Process(target=engine_process, args=(child, model.name, engine_args, threads),
                                   name="lab-engine", daemon=True)
        self.keys = itertools.count()
        self.pending = {}                  # key -> (event loop, admitted future, tokens queue), awaiting an id
        self.streams = {}                  # request id -> (event loop, tokens queue)
        self.replies = queue.SimpleQueue()  # answers to `snapshot`
        self.lock = threading.Lock()       # pending and streams: the event loop's thread and the reader's
        self.send_lock = threading.Lock()  # one message at a time into the pipe, whichever thread sends
        self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    def start(self, timeout_s: float = 600):
        """Start the engine's process and wait until its model is loaded; RuntimeError if it fails to."""
        self.process.start()
        if not self.conn.poll(timeout_s):
            self.process.kill()
            raise RuntimeError(f"the engine's process did not start within {timeout_s} s")
        kind, *info = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"the engine's process failed to start: {info[0]}")
        self.reader.start()

    def stop(self):
        """Cancel whatever is left, end the engine's process and wait for it."""
        with contextlib.suppress(OSError):
            self._send("stop")
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
        self.reader.join(5)

    async def add(self, ids, max_new_tokens: int, eos_id: int | None) -> tuple[int, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        admitted, tokens, key = loop.create_future(), asyncio.Queue(), next(self.keys)
        with self.lock:
            self.pending[key] = (loop, admitted, tokens)
        self._send("add", key, list(ids), max_new_tokens, eos_id)
        return await admitted, tokens

    def cancel(self, rid: int):
        with self.lock:
            self.streams.pop(rid, None)
        with contextlib.suppress(OSError):
            self._send("cancel", rid)

    def snapshot(self, timeout_s: float = 30) -> dict:
        """The engine's stats, free pages and requests in flight, from its process (for tests and checks)."""
        self._send("snapshot")
        return self.replies.get(timeout=timeout_s)

    def _send(self, *message):
        with self.send_lock:
            self.conn.send(message)

    def _read(self):
        """This process's side of the pipe: admissions, tokens, failures, until the engine ends."""
        while True:
            try:
                kind, *args = self.conn.recv()
            except (EOFError, OSError):                     # the engine's process ended
                self._fail(RuntimeError("the engine's process ended"))
                return
            if kind == "admitted":
                key, rid, error = args
                with self.lock:
                    waiting = self.pending.pop(key, None)   # None: failed meanwhile (the engine failed)
                    if waiting is not None and error is None:
                        self.streams[rid] = (waiting[0], waiting[2])
                if waiting is not None:
                    waiting[0].call_soon_threadsafe(settle, self, waiting[1], rid, error)
                elif rid is not None:
                    self.cancel(rid)
            elif kind == "tokens":
                by_loop = {}
                with self.lock:
                    for rid, token, finish in args[0]:
                        stream = self.streams.pop(rid, None) if finish else self.streams.get(rid)
                        if stream is not None:
                            by_loop.setdefault(stream[0], []).append((stream[1], (token, finish)))
                for loop, items in by_loop.items():         # one wake-up of each event loop per step
                    loop.call_soon_threadsafe(deliver, items)
            elif kind == "failed":
                self._fail(RuntimeError(args[0]))
            elif kind == "snapshot":
                self.replies.put(args[0])
            elif kind == "stopped":
                self._fail(RuntimeError("the server stopped"))
                return

    def _fail(self, error: Exception):
        with self.lock:
            waiting, self.pending = list(self.pending.values()), {}
            streams, self.streams = list(self.streams.values()), {}
        for loop, admitted, _ in waiting:
            loop.call_soon_threadsafe(lambda f=admitted: f.done() or f.set_exception(error))
        for loop, tokens in streams:
            loop.call_soon_threadsafe(tokens.put_nowait, error)


def deliver(items):
    for tokens, item in items:
        tokens.put_nowait(item)


def engine_process(conn, model_name: str, engine_args: dict, threads: int | None):
    """The engine's process: load the model, then run an EngineLoop over the pipe (PipeLoop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the server decides when to stop (it drains first)
    try:
        if threads:
            torch.set_num_threads(threads)
        engine = ServingEngine(load(model_name), **engine_args)
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    PipeLoop(engine, conn).run()


class PipeLoop(EngineLoop):
    """EngineLoop in the engine's process: messages come from the pipe, and what a request's stream needs
    goes back through it (admissions, every step's tokens in one message, failures), for EngineProcess."""

    def __init__(self, engine: ServingEngine, conn):
        super().__init__(engine)
        self.conn = conn

    def _receive(self, wait: bool) -> list:
        try:
            messages = [self.conn.recv()] if wait else []
            while self.conn.poll():
                messages.append(self.conn.recv())
        except (EOFError, OSError):                   # the server's process is gone
            return [("stop",)]
        return messages

    def _handle(self, kind, *args):
        if kind == "cancel":
            self.engine.cancel(args[0])               # False if it had finished: fine
        elif kind == "snapshot":
            self.conn.send(("snapshot", dict(self.engine.stats, free_pages=self.engine.manager.num_free,
                                             in_flight=len(self.engine.running) + len(self.engine.waiting))))
        else:
            key, ids, max_new_tokens, eos_id = args
            try:
                self.conn.send(("admitted", key, self.engine.add_request(ids, max_new_tokens, eos_id), None))
            except Exception as e:                    # a bad request: the engine is unchanged
                self.conn.send(("admitted", key, None, e))

    def _step(self):
        self.conn.send(("tokens", finished_tokens(self.engine, self.engine.step())))

    def _stopped(self):
        with contextlib.suppress(OSError):
            self.conn.send(("stopped",))

    def _fail(self, error: Exception):
        for req in self.engine.running + list(self.engine.waiting):
            self.engine.cancel(req.id)
        self.conn.send(("failed", f"{type(error).__name__}: {error}"))


# ---- requests, as OpenAI's API shapes them ----


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is an error, "5" is not 5


class StreamOptions(Strict):
    include_usage: bool = False                # a last chunk with the usage and no choices


class Sampling(Strict):
    """The fields both endpoints take. Accepted and ignored: `user`, `seed` and `top_p` (at temperature 0
    every top_p picks the same token)."""

    model: str | None = None                   # if given, the served model's name
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None           # 0 or absent: the engine decodes greedily
    top_p: float | None = None
    n: int = 1                                 # one choice per request
    stop: str | list[str] | None = None        # only None: the model's eos token stops, no stop strings
    user: str | None = None
    seed: int | None = None
    return_token_ids: bool = False             # vLLM's extension: prompt_token_ids and token_ids in choices


class CompletionRequest(Sampling):
    prompt: str | list[int]                    # text, or token ids
    max_tokens: int = Field(16, ge=1)          # OpenAI's default for completions


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)             # default: as many as the context and pool allow
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens


class APIError(Exception):
    """An error answered as OpenAI answers it: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param=None, code=None, type="invalid_request_error"):
        super().__init__(message)
        self.status, self.body = status, dict(message=message, type=type, param=param, code=code)

    def response(self, headers=None) -> JSONResponse:
        return JSONResponse({"error": self.body}, status_code=self.status, headers=headers)


def parse(raw: bytes, schema):
    """The request body checked against `schema`; APIError (400) naming what is wrong."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        unknown = [err["loc"][0] for err in errors if err["type"] == "extra_forbidden"]
        if unknown:
            raise APIError(400, f"unknown field(s): {', '.join(map(str, unknown))}", param=unknown[0]) from None
        where = lambda err: ".".join(str(p) for p in err["loc"]) or "body"
        raise APIError(400, "; ".join(f"{where(err)}: {err['msg']}" for err in errors),
                       param=str(errors[0]["loc"][0]) if errors[0]["loc"] else None) from None
    if req.temperature not in (None, 0):
        raise APIError(400, f"temperature must be 0 or absent, got {req.temperature}: this server decodes "
                            "greedily", param="temperature")
    if req.stop is not None:
        raise APIError(400, "stop sequences are not supported: a request stops at the model's eos token or "
                            "at max_tokens", param="stop")
    if req.n != 1:
        raise APIError(400, f"n must be 1, got {req.n}: this server returns one choice", param="n")
    return req


# ---- the app ----


def create_app(engine: "ServingEngine | EngineProcess", name: str | None = None, eos_id: int | None = None,
               loop: "EngineLoop | EngineProcess | None" = None) -> FastAPI:
    """The HTTP app over `engine`, serving its model as `name` (default: the model's name). A request stops
    at `eos_id` (default: the tokenizer's eos token, if it has one) or at its max_tokens. With no `loop`, an
    EngineLoop on a thread of its own starts and stops with the app (its lifespan); with one (an
    EngineProcess, as `python -m lab.serve` runs), the caller starts it, and the app's shutdown stops it.
    `app.state.draining = True` refuses new requests (503)."""
    model, tok = engine.model, engine.model.tokenizer
    name = name or model.name
    if eos_id is None:                                # SmolLM2's <|im_end|>; the random models have none
        eos = getattr(tok, "special", {}).get("eos_token")
        eos_ids = tok.encode(eos) if eos else []
        eos_id = eos_ids[0] if len(eos_ids) == 1 else None
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.loop, app.state.draining = loop or EngineLoop(engine), False
        if loop is None:
            app.state.loop.start()
        yield
        app.state.loop.stop()

    app = FastAPI(title="Inference Lab", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)             # 404, 405: FastAPI's statuses, OpenAI's body
    async def http_error(request, e: HTTPException):
        return APIError(e.status_code, str(e.detail), type="not_found_error" if e.status_code == 404
                        else "invalid_request_error").response(e.headers)

    @app.exception_handler(Exception)                 # a bug (the engine's thread failed): 500, OpenAI's body
    async def server_error(request, e: Exception):
        return APIError(500, f"{type(e).__name__}: {e}", type="server_error").response()

    @app.get("/health")
    async def health():
        if app.state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [dict(id=name, object="model", created=started, owned_by="inference-lab",
                                                max_model_len=model.config.max_positions)]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(await request.body(), CompletionRequest)
        ids = tok.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        return await respond(req, ids, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(await request.body(), ChatRequest)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        except (ValueError, jinja2.TemplateError) as e:       # no template, or the template refused
            raise APIError(400, f"cannot render the conversation for {name}: {e}", param="messages") from None
        limit = min(model.config.max_positions, engine.num_pages * engine.page_size)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, limit - len(ids) + 1)
        return await respond(req, ids, max_tokens, chat=True)

    async def respond(req, ids, max_tokens, chat):
        """Admit the request into the engine, then answer with one JSON body or a stream of events."""
        if app.state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
        if req.model is not None and req.model != name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found", type="not_found_error")
        prompt = "messages" if chat else "prompt"
        try:
            rid, tokens = await app.state.loop.add(ids, max_tokens, eos_id)
        except PositionLimitError as e:
            raise APIError(400, f"{e}; shorten the {prompt} or max_tokens", param=prompt,
                           code="context_length_exceeded") from None
        except OutOfPagesError as e:
            raise APIError(400, f"{e}; it could never be served", param=prompt, code="exceeds_kv_pool") from None
        except InputError as e:
            raise APIError(400, str(e), param=prompt) from None
        reply = Reply(tok, name, chat, ids, req.return_token_ids)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(stream(rid, tokens, reply, usage), media_type="text/event-stream")
        done = False
        try:
            while not done:
                done = reply.add(*await next_token(tokens))
        finally:
            if not done:                                     # the handler was cancelled: free the pages
                app.state.loop.cancel(rid)
        return reply.body()

    async def stream(rid, tokens, reply, usage):
        """Server-sent events: one chunk per token, the last with its finish_reason, then [DONE]."""
        done = False
        try:
            while not done:
                done = reply.add(*await next_token(tokens))
                yield f"data: {json.dumps(reply.chunk())}\n\n"
            if usage:
                yield f"data: {json.dumps(reply.chunk(usage=True))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not done:                                     # the client went away: free the pages
                app.state.loop.cancel(rid)

    return app


async def next_token(tokens: asyncio.Queue) -> tuple:
    item = await tokens.get()
    if isinstance(item, Exception):                          # the engine failed: answer 500
        raise item
    return item


class Reply:
    """One request's answer as it grows: its tokens, their text, and the OpenAI objects that carry them."""

    def __init__(self, tokenizer, model: str, chat: bool, prompt_ids, with_ids: bool):
        self.tok, self.model, self.chat, self.prompt_ids, self.with_ids = tokenizer, model, chat, prompt_ids, with_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.ids, self.text = [], ""                       # every token so far, and the text shown of them
        self.new, self.piece, self.finish = [], "", None   # what the last add brought

    def add(self, token: int, finish: str | None) -> bool:
        """Take the next token; True once it was the last. The eos token is not part of the text, and a
        piece that ends inside a multi-byte character waits for the next token."""
        self.ids.append(token)
        self.new, self.finish = [token], finish
        visible = self.ids[:-1] if finish == "stop" else self.ids
        text = self.tok.decode(visible)
        if text.endswith("\ufffd") and not finish:
            self.piece = ""
        else:
            self.piece, self.text = text[len(self.text):], text
        return finish is not None

    def usage(self) -> dict:
        n, m = len(self.prompt_ids), len(self.ids)
        return dict(prompt_tokens=n, completion_tokens=m, total_tokens=n + m)

    def _choice(self, text, ids, finish, stream) -> dict:
        if self.chat:
            key = "delta" if stream else "message"
            message = {"content": text} if stream and self.ids[:-1] else {"role": "assistant", "content": text}
            choice = {"index": 0, key: message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.with_ids:
            choice["token_ids"] = ids
            if not (stream and self.ids[:-1]):             # the first chunk, or the whole answer
                choice["prompt_token_ids"] = list(self.prompt_ids)
        return choice

    def chunk(self, usage=False) -> dict:
        """The streamed chunk for the last token (or, with usage=True, the closing usage chunk)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        out = dict(id=self.id, object=kind, created=self.created, model=self.model)
        if usage:
            return out | dict(choices=[], usage=self.usage())
        return out | dict(choices=[self._choice(self.piece, self.new, self.finish, stream=True)])

    def body(self) -> dict:
        """The whole answer, not streamed."""
        kind = "chat.completion" if self.chat else "text_completion"
        return dict(id=self.id, object=kind, created=self.created, model=self.model,
                    choices=[self._choice(self.text, list(self.ids), self.finish, stream=False)],
                    usage=self.usage())


# ---- the command line ----


class Server(uvicorn.Server):
    """uvicorn's server, with the app told first on SIGINT or SIGTERM: it answers new requests with 503 while
    uvicorn stops listening and waits for the admitted ones to finish; then the engine's loop stops."""

    def __init__(self, config, app):
        super().__init__(config)
        self.lab_app = app

    def handle_exit(self, sig, frame):
        self.lab_app.state.draining = True
        super().handle_exit(sig, frame)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m lab.serve", description="An OpenAI-compatible server over the "
                                "ServingEngine: /v1/completions, /v1/chat/completions, /v1/models, /health.")
    p.add_argument("--model", default="smollm2", help="any lab.models.load name or folder (default smollm2)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-pages", type=int, default=512, help="pages in the pool (default 512: 8,192 positions)")
    p.add_argument("--page-size", type=int, default=16, help="positions per page")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="tokens in one step's forward, at most")
    p.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--one-process", action="store_true", help="step the engine in this process's main thread "
                   "and serve HTTP from a second thread, instead of giving the engine a process of its own")
    args = p.parse_args(argv)
    engine_args = (args.num_pages, args.page_size, args.max_batch_tokens)
    if args.one_process:
        if args.threads:
            torch.set_num_threads(args.threads)
        engine = ServingEngine(load(args.model), *engine_args, prefix_caching=not args.no_prefix_caching)
        loop = EngineLoop(engine)
    else:
        torch.set_num_threads(1)       # this process parses and detokenizes; the engine's has the threads
        model = load(args.model)       # for its tokenizer and config; the engine's process loads its own
        engine = loop = EngineProcess(model, *engine_args, prefix_caching=not args.no_prefix_caching,
                                      threads=args.threads)
        engine.start()
    app = create_app(engine, loop=loop)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"), app)
    where = "in this process" if args.one_process else "in a process of its own"
    print(f"serving {engine.model.name} (pool of {args.num_pages} pages of {args.page_size}, max_batch_tokens="
          f"{args.max_batch_tokens}, the engine {where}) on http://{args.host}:{args.port}", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):   # uvicorn re-raises the signal that stopped it, once it has
        signal.signal(sig, server.handle_exit)   # drained: then ours (a no-op by then) takes it, and exit is 0
    if args.one_process:
        serve_beside(server, loop)
    else:
        try:
            server.run()               # until SIGINT or SIGTERM; the app's shutdown stops the engine
        finally:
            loop.stop()
    raise SystemExit(0 if server.started else 1)


def serve_beside(server, loop: EngineLoop):
    """HTTP from a second thread, the engine stepped in the main thread: torch ran the engine's steps about
    1.3 times slower from a second thread on the book's 2-core machine (chapter 8). Both share one
    interpreter lock."""
    def serve_http():                  # uvicorn installs no signal handlers off the main thread: ours did
        try:
            server.run()
        finally:
            loop.stop()                # a server that ended (or never started) ends the engine's loop

    http = threading.Thread(target=serve_http, name="http", daemon=True)
    http.start()
    loop.run()                         # the engine steps here until the server stops
    http.join()


if __name__ == "__main__":
    main()
