"""The engine's loop (`EngineLoop`, the one piece of code that touches a ServingEngine), run on a thread of this
process (`EngineThread`: server and engine share one interpreter lock) or in a process of its own
(`EngineProcess`, as vLLM runs its engine core apart from its API server); an `EngineClient` wraps either.
"""

import contextlib
import multiprocessing
import os
import queue
import signal
import threading
from multiprocessing import connection

import torch

from ..engine import ServingEngine, beam_search
from ..models import load
from ..models.load import load_config


# ---- the loop ----
class EngineLoop:
    """Adds, cancels and steps, in that order, round after round. `transport.receive(wait)` returns the messages
    that arrived (with `wait`, at least one); `transport.send(message)` answers. A loop of another role
    (lab/serve/disagg.py: prefill, decode) overrides `engine_class`, `connect`, `_handle`, `admit` and `answer`."""

    engine_class = ServingEngine
    warm_up = staticmethod(lambda engine: None)   # before "ready": a measured worker runs a request

    def __init__(self, engine: ServingEngine, transport):
        self.engine, self.transport = engine, transport
        self.kv_events = KVEvents(engine.manager)

    @classmethod
    def connect(cls, engine, conn, kv=None):
        """The loop of an engine's process, over its pipe to the server (`kv`: a pipe to another worker)."""
        return cls(engine, PipeTransport(conn))

    def run(self):
        """Until a ("stop",) message: every request still in flight is cancelled, then ("stopped",)."""
        engine = self.engine
        while True:
            try:
                for kind, *args in self.transport.receive(wait=not self.busy()):
                    if kind == "stop":
                        self._cancel_all()
                        self.transport.send(("stopped",))
                        return
                    self._handle(kind, *args)
                self.admit()
                if engine.running or engine.waiting:
                    for message in self.answer(engine.step()):
                        self.transport.send(message)
            except Exception as e:                       # a bug: every request fails (500), none hangs
                self._cancel_all()
                self.transport.send(("failed", f"{type(e).__name__}: {e}"))

    def busy(self) -> bool:
        """Work to do without a new message: a request waits or runs."""
        return bool(self.engine.running or self.engine.waiting)

    def admit(self):
        """Before each step: work the loop keeps besides the engine's queue (none here)."""

    def answer(self, new: dict) -> list:
        """The messages a step's new tokens make: one, the step's tokens and KV events."""
        return [("tokens", finished_tokens(self.engine, new), self.kv_events.take())]

    def _handle(self, kind, *args):
        if kind == "add":
            key, ids, max_new_tokens, eos_id, sampling = args
            try:
                rid, error = self.engine.add_request(ids, max_new_tokens, eos_id, **sampling), None
            except Exception as e:                       # a bad request: the engine is unchanged
                rid, error = None, e
            self.transport.send(("admitted", key, rid, error))
        elif kind == "beam":                             # the whole search, here: other requests wait meanwhile
            key, ids, max_new_tokens, eos_id, params = args
            try:
                r = beam_search(self.engine.model, ids, max_new_tokens=max_new_tokens, eos_id=eos_id,
                                page_size=self.engine.page_size, **params)
                self.transport.send(("beam", key, (r.sequences, r.scores), None))
            except Exception as e:                       # a bad request
                self.transport.send(("beam", key, None, e))
        elif kind == "cancel":
            self.engine.cancel(args[0])                  # False if it had finished: fine
        elif kind == "snapshot":
            engine = self.engine
            free, named = engine.manager.num_free, engine.manager.cached_pages()     # free: group -> pages
            self.transport.send(("snapshot", dict(engine.stats, free_pages=free, named_pages=named,
                                                  in_flight=len(engine.running) + len(engine.waiting))))
        else:
            raise ValueError(f"unknown message {kind!r} for the engine's loop")

    def _cancel_all(self):
        for req in self.engine.running + list(self.engine.waiting):
            with contextlib.suppress(Exception):         # an engine that failed mid-step may refuse: go on
                self.engine.cancel(req.id)


class KVEvents:
    """The pages a BlockManager named ("stored", digest) and evicted ("removed", digest) since the
    last `take`, recorded by its hooks: Dynamo's KV events, sent with each step. A hybrid pool
    (chapter 10) and a radix tree (chapter 11) report none: a fleet then routes on load alone."""

    def __init__(self, manager):
        self.events = []
        if manager.index != "hash" or len(manager.groups) > 1:
            return
        manager = manager.manager(manager.groups[0])      # the one group's pages, named by the chain
        evict = manager.on_evict

        def evicted(page, key):
            if evict is not None:
                evict(page, key)
            self.events.append(("removed", key[0]))

        manager.on_name = lambda page, key: self.events.append(("stored", key[0]))
        manager.on_evict = evicted

    def take(self) -> list:
        events, self.events = self.events, []
        return events


def finished_tokens(engine: ServingEngine, new: dict) -> list:
    """(request id, token, finish_reason) for each of one step's new tokens: None while a request runs,
    "stop" at its eos token, "length" at its max_tokens."""
    out = []
    for rid, tokens in new.items():
        req = engine.requests[rid]
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1 and req.state == "finished"
            out.append((rid, token, None if not last else "stop" if token == req.eos_id else "length"))
    return out


# ---- transports ----
class QueueTransport:
    """The loop's side in a thread: messages from a queue, answers straight to `deliver` (the EngineClient's)."""

    def __init__(self, deliver):
        self.inbox, self.deliver = queue.SimpleQueue(), deliver

    def receive(self, wait: bool) -> list:
        messages = [self.inbox.get()] if wait else []
        with contextlib.suppress(queue.Empty):
            while True:
                messages.append(self.inbox.get_nowait())
        return messages

    def send(self, message):
        self.deliver(message)


class PipeTransport:
    """The loop's side in the engine's process: messages from the pipe (and from `more` pipes: another
    worker's), answers into the first."""

    def __init__(self, conn, *more):
        self.conn, self.conns = conn, [conn, *more]

    def receive(self, wait: bool) -> list:
        messages = []
        try:
            for conn in connection.wait(self.conns, None if wait else 0):
                while conn.poll():
                    messages.append(conn.recv())
        except (EOFError, OSError):                      # the server's process (or the other worker) is gone
            return [("stop",)]
        return messages

    def send(self, message):
        with contextlib.suppress(OSError):               # the server's process is gone: nobody to tell
            self.conn.send(message)


# ---- the two modes ----
class EngineThread:
    """The loop on a thread of this process. `start` runs it on a thread of its own (an app served inside
    another program: the tests); `python -m lab.serve --one-process` calls `run` in its main thread."""

    def __init__(self, engine: ServingEngine):
        transport = QueueTransport(lambda message: self.deliver(message))
        self.send, self.deliver = transport.inbox.put, None       # deliver: the EngineClient's, once it wraps this
        self.engine, self.loop, self.thread = engine, EngineLoop(engine, transport), None
        self.name, self.config, self.tokenizer = engine.model.name, engine.model.config, engine.model.tokenizer
        self.num_pages, self.page_size, self.extra = engine.num_pages, engine.page_size, engine.extra

    def start(self):
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.thread.start()

    def run(self):
        self.loop.run()

    def stop(self):
        """Cancel whatever is left and end the loop (and wait for its thread, if it has one)."""
        self.send(("stop",))
        if self.thread is not None:
            self.thread.join()


class EngineProcess:
    """The loop in a process of its own, over the model `load(model, dtype)` returns; the server's side loads only
    the tokenizer and the config. `extra` (what page names chain from) comes from the process once ready. The
    process ending unexpectedly is delivered as ("exited", why): its EngineClient fails every request from then.
    `loop`: the EngineLoop class to run; `kv`: one end of a pipe to another worker (serve/disagg.py); `fast_decode`:
    ServingEngine's."""

    def __init__(self, model: str, num_pages: int, page_size: int = 16, max_batch_tokens: int = 256,
                 prefix_caching: bool = True, threads: int | None = None, dtype: str = "float32",
                 loop=EngineLoop, kv=None, name: str = "lab-engine", fast_decode: bool | int | str = True):
        self.config, self.tokenizer = load_config(model, dtype)       # DtypeError here, before a process starts
        self.name, self.num_pages, self.page_size = self.config.name, num_pages, page_size
        self.fast_decode = fast_decode
        ctx = multiprocessing.get_context("spawn")      # a fresh interpreter: no forked torch thread pools
        self.conn, child = ctx.Pipe()
        self.send_lock = threading.Lock()               # one message at a time into the pipe, whichever thread
        engine_args = dict(num_pages=num_pages, page_size=page_size, max_batch_tokens=max_batch_tokens,
                           prefix_caching=prefix_caching)
        if fast_decode is not True:                     # ServingEngine's default (the disaggregated loops' engines
            engine_args["fast_decode"] = fast_decode    # take only that)
        self.process = ctx.Process(target=engine_process, name=name, daemon=True,
                                   args=(child, model, engine_args, threads, self.config.dtype, loop, kv))
        self._child = child
        self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self.extra, self.deliver = None, None           # deliver: the EngineClient's, once it wraps this
        self.fast = None                                # once ready: {"rows", "timings"} of its fused step, if any

    def start(self, timeout_s: float = 600):
        """Start the engine's process and wait until its model is loaded; RuntimeError if it fails to."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self):
        """Start the engine's process; it loads its model meanwhile (`wait_ready` waits for it). A fleet
        launches every worker, then waits, so that they load at once."""
        # the child's pages and packed weights in 2 MiB pages (chapter 8); a value already set wins
        before = os.environ.get("THP_MEM_ALLOC_ENABLE")
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        try:
            self.process.start()
        finally:
            if before is None:
                del os.environ["THP_MEM_ALLOC_ENABLE"]
        self._child.close()                             # the process's end lives there: its death reads as EOF

    def wait_ready(self, timeout_s: float = 600):
        """Wait until the launched process has loaded its model; RuntimeError if it does not."""
        if not self.conn.poll(timeout_s):
            self.process.kill()
            raise RuntimeError(f"the engine's process did not start within {timeout_s} s")
        try:
            kind, *info = self.conn.recv()
        except EOFError:
            kind, info = "failed", [f"it ended (exit code {self.process.exitcode})"]
        if kind != "ready":
            raise RuntimeError(f"the engine's process failed to start: {info[0]}")
        self.extra, self.fast = info[0], info[1] if len(info) > 1 else None
        self.reader.start()

    def stop(self):
        """Cancel whatever is left, end the engine's process and wait for it (nothing, if never launched)."""
        if self.process.pid is None:
            return
        with contextlib.suppress(OSError):
            self.send(("stop",))
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
        if self.reader.ident is not None:               # started: the process was ready
            self.reader.join(5)

    def send(self, message):
        with self.send_lock:
            self.conn.send(message)

    def _read(self):
        """This process's side of the pipe: every answer to `deliver`, until the engine ends."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):                  # the engine's process ended without a word
                self.process.join(5)
                message = ("exited", f"the engine's process ended (exit code {self.process.exitcode})")
            self.deliver(message)
            if message[0] in ("stopped", "exited"):
                return


def engine_process(conn, model: str, engine_args: dict, threads: int | None, dtype: str = "float32",
                   loop=EngineLoop, kv=None):
    """The engine's process: load the model in `dtype`, then run `loop` over the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)         # the server decides when to stop (it drains first)
    try:
        if threads:
            torch.set_num_threads(threads)
        engine = loop.engine_class(load(model, dtype), **engine_args)
        loop.warm_up(engine)
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    fast = getattr(engine, "fast", None)
    conn.send(("ready", engine.extra, fast and dict(rows=fast.rows, timings=fast.timings)))
    loop.connect(engine, conn, kv).run()
