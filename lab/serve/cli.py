"""`python -m lab.serve`: the command line. The engine runs in a process of its own unless `--one-process`;
`--workers N` runs N engines, a process each, behind one router (lab/serve/fleet.py).

If an engine's process dies, its requests in flight fail (a streamed one with an error event), /health and new
requests get 503, the other workers' requests finish, and the server exits 1. It restarts nothing itself: a
supervisor (systemd's Restart=on-failure, Kubernetes' restartPolicy) restarts a process that exits non-zero, with
back-off and logging; restarting in place would hide a crash loop.

On SIGINT or SIGTERM the server refuses new requests (503), lets the admitted ones finish, stops the engine, exits
0.
"""

import argparse
import contextlib
import math
import os
import signal
import threading

import torch
import uvicorn

from .. import threads
from ..engine import ServingEngine
from ..engine.fast import FusedStep
from ..fleet import POLICIES
from ..kernels.step import ROWS
from ..models import load
from ..models.config import DTYPES
from .api import MAX_BODY_BYTES
from .app import create_app
from .client import EngineClient
from .engine_loop import EngineProcess, EngineThread
from .fleet import Fleet


class Server(uvicorn.Server):
    """uvicorn's server, with the app told first on SIGINT or SIGTERM: it answers new requests with 503 while
    uvicorn stops listening and waits for the admitted ones to finish; then the engine's loop stops."""

    def __init__(self, config, app):
        super().__init__(config)
        self.lab_app = app

    def handle_exit(self, sig, frame):
        self.lab_app.state.draining = True
        super().handle_exit(sig, frame)


def workers_arg(text: str) -> int:
    """--workers: an int of at least 1 (argparse says which argument, and exits 2)."""
    with contextlib.suppress(ValueError):
        if (n := int(text)) >= 1:
            return n
    raise argparse.ArgumentTypeError(f"the number of engine processes is an int of at least 1, got {text!r}")


def weight_arg(text: str) -> float:
    """--router-overlap-weight: a finite number >= 0."""
    with contextlib.suppress(ValueError):
        if math.isfinite(w := float(text)) and w >= 0:
            return w
    raise argparse.ArgumentTypeError(f"a weight is a finite number >= 0, got {text!r}")


def fast_decode_arg(text: str):
    if text in ("measure", "off"):
        return {"measure": "measure", "off": False}[text]
    if text.isdigit() and int(text) <= ROWS:
        return int(text)
    raise argparse.ArgumentTypeError(f"measure, off or a number of decodes from 0 to {ROWS}, got {text!r}")


def fused_line(engine) -> str:
    """What the engine's fused step takes (an EngineThread's or an EngineProcess's), and what it measured."""
    fast = engine.fast if isinstance(engine, EngineProcess) else engine.engine.fast
    if isinstance(fast, FusedStep):
        fast = dict(rows=fast.rows, timings=fast.timings)
    if not fast:
        return "every step through forward_cached (no fused step for this model and dtype, or --fast-decode off)"
    if not fast["rows"]:
        return "every step through forward_cached (" + ("--fast-decode 0)" if not fast["timings"] else
                                                          "measured: the fused step was slower at every size)")
    times = ", ".join(f"{b}: {t['fused'] * 1e3:.1f} / {t['reference'] * 1e3:.1f}" for b, t in (fast["timings"] or
                                                                                               {}).items())
    return f"fused decode steps of up to {fast['rows']} sequences" + (
        f" (measured, sequences: fused / reference ms: {times})" if times else "")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m lab.serve", description="An OpenAI-compatible server over the "
                                "ServingEngine: /v1/completions, /v1/chat/completions, /v1/models, /health.")
    p.add_argument("--model", default="smollm2", help="any lab.models.load name or folder (default smollm2)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the weights', activations' and cache's "
                   "dtype (default float32; bfloat16 halves the cache and runs natively on CPUs with AVX-512 BF16)")
    p.add_argument("--num-pages", type=int, default=512, help="pages in the pool (default 512: 8,192 positions)")
    p.add_argument("--page-size", type=int, default=16, help="positions per page")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="tokens in one step's forward, at most")
    p.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--wait-policy", default="spin", choices=threads.WAIT_POLICIES, help="how the engine's OpenMP "
                   "threads wait between operators (default spin, OpenMP's own: the fastest when the server owns "
                   "its cores; passive: they sleep at once, kinder to a busy laptop; an OMP_WAIT_POLICY in the "
                   "environment wins). With --one-process the process keeps the setting it started with")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger request bodies get 413 "
                   f"(default {MAX_BODY_BYTES:,}: 1 MiB, the default model's whole context is about 40 KB)")
    p.add_argument("--one-process", action="store_true", help="step the engine in this process's main thread "
                   "and serve HTTP from a second thread, instead of giving the engine a process of its own")
    p.add_argument("--workers", type=workers_arg, default=1, help="engines, each in a process of its own, "
                   "behind one router (default 1: one engine, without a router)")
    p.add_argument("--router", default="round_robin", choices=POLICIES, help="which worker takes a request, "
                   "with --workers above 1 (default round_robin; least_loaded: fewest pages in flight; "
                   "kv_aware: NVIDIA Dynamo's cost, prefill pages not cached against pages in use)")
    p.add_argument("--router-overlap-weight", type=weight_arg, default=1.0, help="kv_aware's weight on the "
                   "pages to prefill (default 1.0, Dynamo's: higher favours cache hits, lower even load)")
    p.add_argument("--fast-decode", type=fast_decode_arg, default="measure", help="how many decodes a step may "
                   "hold to run in one C++ call (lab/engine/fast.py): measure (default: as many as it was no slower "
                   "for than the reference step, timed at start, a few seconds), off, or a number from 0 to "
                   f"{ROWS}")
    args = p.parse_args(argv)
    if args.one_process and args.workers > 1:
        p.error(f"--one-process runs one engine in the server's process; --workers {args.workers} needs "
                "a process per engine")
    engine_args = (args.num_pages, args.page_size, args.max_batch_tokens)
    if args.one_process:
        if args.threads:
            torch.set_num_threads(args.threads)
        client = EngineClient(EngineThread(ServingEngine(load(args.model, args.dtype), *engine_args,
                                                         prefix_caching=not args.no_prefix_caching,
                                                         fast_decode=args.fast_decode)))
    else:
        torch.set_num_threads(1)       # this process parses and detokenizes; the engines' have the threads
        threads.for_engines(args.wait_policy)
        workers = [EngineClient(EngineProcess(args.model, *engine_args, prefix_caching=not args.no_prefix_caching,
                                              threads=args.threads, dtype=args.dtype, fast_decode=args.fast_decode))
                   for _ in range(args.workers)]
        client = workers[0] if args.workers == 1 else Fleet(workers, args.router, args.router_overlap_weight)
    app = create_app(client, max_body_bytes=args.max_body_bytes)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"), app)
    died = []

    def engine_died(why: str):         # from the reader thread: fail fast, let the supervisor restart us
        print(f"{why}: stopping the server", flush=True)
        died.append(why)
        server.should_exit = True

    if not args.one_process:
        client.on_exit = engine_died
        client.start()
    where = ("the engine in this process" if args.one_process else "the engine in a process of its own"
             if args.workers == 1 else f"{args.workers} engines, a process each, behind a {args.router} router")
    policy = os.environ.get("OMP_WAIT_POLICY", "OpenMP's default")
    n = torch.get_num_threads() if args.one_process else args.threads or "torch's default"
    print(f"serving {client.name} in {args.dtype} (pool of {args.num_pages} pages of {args.page_size}"
          f"{' each' if args.workers > 1 else ''}, max_batch_tokens={args.max_batch_tokens}, {where}, "
          f"{n} threads, wait policy {policy}) on http://{args.host}:{args.port}", flush=True)
    for i, w in enumerate([client] if args.workers == 1 else client.workers):
        print(("" if args.workers == 1 else f"worker {i}: ") + fused_line(w.engine), flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):   # uvicorn re-raises the signal that stopped it, once it has
        signal.signal(sig, server.handle_exit)   # drained: then ours (a no-op by then) takes it, and exit is 0
    if args.one_process:
        serve_beside(server, client)
    else:
        try:
            server.run()               # until SIGINT or SIGTERM; the app's shutdown stops the engine
        finally:
            client.stop()
    raise SystemExit(0 if server.started and not died else 1)


def serve_beside(server, client: EngineClient):
    """HTTP from a second thread, the engine stepped in the main thread: torch ran the engine's steps about 1.3
    times slower from a second thread on the book's 2-core machine (chapter 8). Both share one interpreter lock."""
    def serve_http():                  # uvicorn installs no signal handlers off the main thread: ours did
        try:
            server.run()
        finally:
            client.stop()              # a server that ended (or never started) ends the engine's loop

    http = threading.Thread(target=serve_http, name="http", daemon=True)
    http.start()
    client.engine.run()                # the engine steps here until the server stops
    http.join()
