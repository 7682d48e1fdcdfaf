"""Disaggregated prefill and decode (chapter 11): the engine loop in two roles, in two processes. A `PrefillLoop`
sends each prompt's PageSet over a one-way pipe to a `DecodeLoop`, which takes them in order as its pages free up.
A pipe keeps order, applies backpressure and needs no cleanup when a worker dies; shared memory would save two
copies that cost far less than the forward, at the price of names and unlinks a crash skips.
"""

import multiprocessing
import queue
from collections import deque

from ..cache import OutOfPagesError
from ..engine.disagg import DecodeEngine, PageSet, PrefillEngine, WorkerError, checked, clock, entry, warm_up
from .engine_loop import EngineLoop, EngineProcess, PipeTransport


class PrefillLoop(EngineLoop):
    """The prefill worker's loop: ("add", (tag, max_new_tokens), ids, ...) from the parent; each PageSet, with
    its tag, max_new_tokens and the time of its first token, to the decode worker's pipe `kv`."""

    engine_class = PrefillEngine
    warm_up = staticmethod(lambda engine: warm_up(engine.model, engine.page_size))

    def __init__(self, engine, transport, kv):
        super().__init__(engine, transport)
        self.kv, self.keys = kv, {}                    # request id -> (tag, max_new_tokens)

    @classmethod
    def connect(cls, engine, conn, kv=None):
        return cls(engine, PipeTransport(conn), kv)

    def _handle(self, kind, *args):
        if kind != "add":
            return super()._handle(kind, *args)
        key, ids = args[:2]
        self.keys[self.engine.add_request(ids)] = key  # a bad prompt raises: the loop reports it

    def answer(self, new: dict) -> list:
        t = clock()
        for rid, ps in new.items():
            self.kv.send(("handoff", *self.keys.pop(rid), t, ps.to_bytes()))
        return []


class DecodeLoop(EngineLoop):
    """The decode worker's loop: page sets from the prefill worker's pipe, taken in order while the pages
    last; ("done", tag, tokens, times, bytes) to the parent as each request finishes."""

    engine_class = DecodeEngine
    warm_up = PrefillLoop.warm_up

    def __init__(self, engine, transport):
        super().__init__(engine, transport)
        self.queue, self.info = deque(), {}             # page sets not yet taken; rid -> (tag, times, bytes)

    @classmethod
    def connect(cls, engine, conn, kv=None):
        return cls(engine, PipeTransport(conn, kv))

    def busy(self) -> bool:
        return super().busy() or bool(self.queue)

    def _handle(self, kind, *args):
        if kind != "handoff":
            return super()._handle(kind, *args)
        self.queue.append(args)

    def admit(self):
        while self.queue:                               # hand-offs in order, while the pages last
            tag, new, t_first, data = self.queue[0]
            try:
                rid = self.engine.add_prefilled(PageSet.from_bytes(data), new)
            except OutOfPagesError:
                if not self.engine.running:             # it would not fit an idle engine: never
                    self.queue.popleft()                # (dropped, or the loop would fail on it again)
                    raise
                return
            self.queue.popleft()
            self.info[rid] = tag, [t_first], len(data)
            if self.engine.requests[rid].done:          # done at its first token
                self.transport.send(self._done(rid))

    def answer(self, new: dict) -> list:
        t = clock()
        for rid, tokens in new.items():
            self.info[rid][1].extend([t] * len(tokens))
        return [self._done(rid) for rid in new if self.engine.requests[rid].done]

    def _done(self, rid):
        tag, times, nbytes = self.info.pop(rid)
        return ("done", tag, self.engine.output(rid), times, nbytes)


class Disaggregated:
    """A prefill worker and a decode worker (module docstring), each a process with one thread, loading `model` (a
    name `lab.models.load` knows), with `prefill_pages` and `decode_pages` pages. Use it as a context manager, or
    call `close()`. A worker that fails, dies or goes silent for `timeout_s` raises WorkerError in `generate`."""

    def __init__(self, model: str, prefill_pages: int, decode_pages: int, page_size: int = 16,
                 max_batch_tokens: int = 256, timeout_s: float = 120.0):
        self.timeout_s, self._tags, self.inbox = timeout_s, 0, queue.SimpleQueue()
        kv_in, kv_out = multiprocessing.get_context("spawn").Pipe(duplex=False)   # prefill -> decode
        self.workers = [EngineProcess(model, pages, page_size, max_batch_tokens, threads=1, loop=loop, kv=kv,
                                      name=name)
                        for name, loop, pages, kv in (("lab-prefill", PrefillLoop, prefill_pages, kv_out),
                                                      ("lab-decode", DecodeLoop, decode_pages, kv_in))]
        for w in self.workers:
            w.deliver = lambda message, w=w: self.inbox.put((w, message))
            w.launch()                                  # both load their model at once
        kv_in.close()                                   # the workers' ends live in the workers:
        kv_out.close()                                  # a dead worker reads as EOF
        try:
            for w in self.workers:
                w.wait_ready(timeout_s)
        except RuntimeError as e:
            self.close()
            raise WorkerError(str(e)) from None

    def generate(self, prompts, max_new_tokens, arrivals_s=None) -> tuple[list, list]:
        """Greedy continuations of `prompts`, each up to `max_new_tokens` (an int or one per prompt), prompt i
        sent to the prefill worker `arrivals_s[i]` seconds after the call (0 for all by default). Returns
        (tokens, timeline): the timeline per prompt in order, in seconds since the call (see `entry`)."""
        prompts, news, arrivals = checked(prompts, max_new_tokens, arrivals_s)
        n = len(prompts)
        tags = list(range(self._tags, self._tags + n))                # ids of this call's requests
        self._tags += n
        order, done, k, t0 = sorted(range(n), key=lambda i: arrivals[i]), {}, 0, clock()
        while len(done) < n:
            while k < n and t0 + arrivals[order[k]] <= clock():       # its arrival: to the prefill worker
                i = order[k]
                self.workers[0].send(("add", (tags[i], news[i]), prompts[i], 2, None))
                k += 1
            wait = t0 + arrivals[order[k]] - clock() if k < n else self.timeout_s
            try:
                w, message = self.inbox.get(timeout=max(0.0, wait))
            except queue.Empty:
                if k < n:
                    continue
                raise WorkerError(f"no worker said anything for {self.timeout_s} s") from None
            if message[0] in ("failed", "exited", "stopped"):
                # a worker that dies breaks the other's pipe: name it too, whichever of the two spoke first. Its
                # pipe closes before its exit can be seen, so give the others a moment to be seen exiting
                for x in self.workers:
                    if x is not w:
                        x.process.join(timeout=1.0)
                dead = [x.process.name for x in self.workers if x is not w and not x.process.is_alive()]
                raise WorkerError(f"{w.process.name} failed: {message[1] if len(message) > 1 else 'it stopped'}"
                                  + (f" ({', '.join(dead)} is not running)" if dead else ""))
            if message[0] == "done":
                _, tag, tokens, times, nbytes = message
                done[tag] = tokens, times, nbytes
        return [done[t][0] for t in tags], [entry(i, p, done[t][0], t0 + a, done[t][1], done[t][2], t0)
                                            for i, (t, p, a) in enumerate(zip(tags, prompts, arrivals, strict=True))]

    def close(self):
        """End both workers, decode first (so it never reads the prefill's end closing). Safe to call twice."""
        for w in reversed(self.workers):
            try:
                w.stop()
            except (OSError, ValueError):               # a dead worker, a closed pipe
                w.process.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Disaggregated", "PrefillLoop", "DecodeLoop", "WorkerError"]
