"""The server's side of the engine: which request each message from the engine's loop belongs to.

`EngineClient` puts each answer of the loop (admissions, tokens, failures) on the asyncio queue of its request,
fails them all when the engine fails or its process ends, and keeps what a router (lab/serve/fleet.py) reads: the
prompt sizes of the requests in flight, and the digests of the pages the engine holds named.
"""

import asyncio
import itertools
import queue
import threading


class EngineFailed(RuntimeError):
    """The engine's loop failed or ended while this request waited: the request cannot finish."""


class RequestIdError(TypeError):
    """A request id that is not an int (True and 2.0 are not the ids 1 and 2)."""


class EngineClient:
    """Requests in, (token, finish_reason) pairs out on each request's asyncio.Queue. `engine` (an EngineThread or
    EngineProcess) runs the loop (`start`, `stop`) and describes it. `alive` turns False for good once the engine
    failed or ended (why: `failure`); `on_exit(why)` is called when its process ends unexpectedly."""

    def __init__(self, engine):
        self.engine, self.send, engine.deliver = engine, engine.send, self.receive
        self.name, self.config, self.tokenizer = engine.name, engine.config, engine.tokenizer
        self.num_pages, self.page_size = engine.num_pages, engine.page_size
        self.start, self.stop = engine.start, engine.stop
        self.keys = itertools.count()
        self.pending = {}                   # key -> (event loop, admitted future, tokens queue, prompt tokens)
        self.streams = {}                   # request id -> (event loop, tokens queue, prompt tokens)
        self.named = set()                  # digests of the pages the engine holds named (its KV events)
        self.replies = queue.SimpleQueue()  # answers to `snapshot`
        self.lock = threading.Lock()        # pending and streams: the event loop's thread and the reader's
        self.failure, self.on_exit = None, None   # an EngineFailed, once the engine can take nothing more

    @property
    def alive(self) -> bool:
        return self.failure is None

    async def add(self, ids, max_new_tokens: int, eos_id: int | None, **sampling) -> tuple[int, asyncio.Queue]:
        """Queue a request; its id and the queue its (token, finish_reason, index) triples (or an
        EngineFailed) arrive on. `sampling`: add_request's n, temperature, seed; the n answers are
        the requests id .. id + n - 1. Raises what the engine's `add_request` raises."""
        if self.failure is not None:
            raise self.failure
        loop = asyncio.get_running_loop()
        admitted, tokens, key = loop.create_future(), asyncio.Queue(), next(self.keys)
        with self.lock:
            self.pending[key] = (loop, admitted, tokens, len(ids), sampling.get("n", 1))
        self.send(("add", key, list(ids), max_new_tokens, eos_id, sampling))
        return await admitted, tokens

    async def beam(self, ids, max_new_tokens: int, eos_id: int | None, **params) -> tuple[list, list]:
        """Beam search over `ids` in the engine's loop (lab.engine.beam_search: num_beams, length_penalty,
        early_stopping): the best hypotheses' tokens and scores, once the whole search has run."""
        if self.failure is not None:
            raise self.failure
        loop = asyncio.get_running_loop()
        done, key = loop.create_future(), next(self.keys)
        with self.lock:
            self.pending[key] = (loop, done, None, len(ids), 0)
        self.send(("beam", key, list(ids), max_new_tokens, eos_id, params))
        return await done

    def cancel(self, rid: int, n: int = 1):
        """Drop request `rid` (and the n - 1 answers after it): its pages are freed, its stream gets nothing more."""
        if type(rid) is not int:
            raise RequestIdError(f"a request id is an int, got {rid!r} ({type(rid).__name__})")
        with self.lock:
            for r in range(rid, rid + n):
                self.streams.pop(r, None)
        if self.alive:
            for r in range(rid, rid + n):
                self.send(("cancel", r))

    def in_flight(self) -> list[int]:
        """The prompt tokens of every request in flight: sent and not yet finished, cancelled or failed."""
        with self.lock:
            return [p[3] for p in self.pending.values()] + [s[2] for s in self.streams.values()]

    def snapshot(self, timeout_s: float = 30) -> dict:
        """The engine's stats, free pages and requests in flight, from its loop (for tests and checks)."""
        self.send(("snapshot",))
        return self.replies.get(timeout=timeout_s)

    def receive(self, message: tuple):
        """One message from the engine's loop: ("admitted", key, rid, error), ("tokens", [(rid, token,
        finish_reason), ...], kv_events), ("beam", key, result, error), ("snapshot", dict), ("failed", why),
        ("stopped",), or ("exited", why) from a process that ended without a word. kv_events (("stored" or
        "removed", digest), in order) are applied first, so a client with its answer finds its pages counted."""
        kind, *args = message
        if kind == "admitted":
            key, rid, error = args
            with self.lock:
                waiting = self.pending.pop(key, None)    # None: failed meanwhile
                if waiting is not None and error is None:
                    for i in range(waiting[4]):          # the n answers, on one queue
                        self.streams[rid + i] = (waiting[0], waiting[2], waiting[3], i)
            if waiting is not None:
                waiting[0].call_soon_threadsafe(settle, self, waiting[1], rid, error)
            elif rid is not None:
                self.cancel(rid)
        elif kind == "tokens":
            items, kv_events = args
            for event, digest in kv_events:
                (self.named.add if event == "stored" else self.named.discard)(digest)
            by_loop = {}
            with self.lock:
                for rid, token, finish in items:
                    stream = self.streams.pop(rid, None) if finish else self.streams.get(rid)
                    if stream is not None:
                        by_loop.setdefault(stream[0], []).append((stream[1], (token, finish, stream[3])))
            for loop, items in by_loop.items():          # one wake-up of each event loop per step
                loop.call_soon_threadsafe(deliver, items)
        elif kind == "beam":
            key, result, error = args
            with self.lock:
                waiting = self.pending.pop(key, None)
            if waiting is not None:
                waiting[0].call_soon_threadsafe(settle, None, waiting[1], result, error)
        elif kind == "snapshot":
            self.replies.put(args[0])
        elif kind == "failed":                           # a bug in a step: these requests fail, the loop lives
            self.fail(EngineFailed(args[0]))
        elif kind == "stopped":
            self.fail(EngineFailed("the server stopped"), final=True)
        elif kind == "exited":
            self.fail(EngineFailed(args[0]), final=True)
            if self.on_exit is not None:
                self.on_exit(args[0])

    def fail(self, error: EngineFailed, final: bool = False):
        """Hand `error` to every request waiting for an id or tokens; with `final`, refuse every later one."""
        with self.lock:
            waiting, self.pending = list(self.pending.values()), {}
            streams, self.streams = list(self.streams.values()), {}
            if final and self.failure is None:
                self.failure = error
        for loop, admitted, *_ in waiting:
            loop.call_soon_threadsafe(lambda f=admitted: f.done() or f.set_exception(error))
        for loop, tokens, *_ in streams:
            loop.call_soon_threadsafe(tokens.put_nowait, error)


def settle(client: EngineClient | None, future: asyncio.Future, result, error):
    """On the event loop: answer the handler waiting in `add` (its request id) or `beam` (client
    None: its result); if it stopped waiting, cancel the request `add` admitted."""
    if future.cancelled():                                # the client left before it was answered
        if client is not None and result is not None:
            client.cancel(result)
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def deliver(items):
    for tokens, item in items:
        tokens.put_nowait(item)
