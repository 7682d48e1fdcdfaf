"""Chapter 7's quantized caches beside llama.cpp's cache types, by KL divergence on the same tokens.

llama.cpp quantizes its cache in blocks (`-ctk` for keys, `-ctv` for values): q8_0 stores 32 values along the
head dimension as 32 int8 codes and one float16 scale (34 bytes), q4_0 as 16 bytes of 4-bit codes and the
scale (18 bytes). Since its PR #21038 it also turns queries, keys and values by a 64 x 64 Hadamard matrix
before a quantized cache stores them, and turns the attention's output back; LLAMA_ATTN_ROT_DISABLE=1
switches that off. `RUNS` runs both. A quantized V cache needs flash attention (`-fa on`), and with flash
attention on llama.cpp casts an f32 cache to f16 before attending (src/llama-graph.cpp), so the float32
base runs with `-fa off`: float32 keys and values, float32 attention, as the lab's float cache.

How `llama-perplexity --kl-divergence` scores (tools/perplexity/perplexity.cpp in the vendored source). It
tokenizes the text file (SmolLM2's vocabulary adds no BOS, so a chunk starts with the text's own token), cuts
the ids into chunks of c = `-c` tokens, and runs each chunk as one batch through an emptied cache. At
positions c/2 .. c-2 of each chunk (c/2 - 1 of them, each predicting the next token) it compares the
next-token distribution with the one `--kl-divergence-base` saved, a run with the base cache type: the mean
KL(base || run) over those positions, its standard error, and how often the top token agrees ("Same top p").
Within a batch llama.cpp writes the chunk's keys and values into the cache and attention reads them back
from it, so every position sees every key and value quantized, its own included.

The lab's side (`lab_kl`) scores the same ids at the same positions. QuantizedCache attends a step's own
keys and values in float, as KIVI and transformers' QuantizedCache do, so a chunk fed in one step would see
no quantization at all and score KL 0. `ReadBackCache` stores every key and value as the quantized cache
gives it back (`QuantizedCache.round_trip`) before attention reads it: llama.cpp's way of reading its cache.
"""

import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import data
from ..cache import ConcatCache, QuantizedCache, cache_bytes
from ..metrics import kl_divergence
from ..models import forward_cached
from ..results import not_run, value
from . import llamacpp

# llama.cpp's runs, name -> (type of the K and V cache, flash attention, Hadamard rotation on a quantized
# cache). "f32" has the base's settings: its KL is the floor the base file's 16-bit log-probabilities leave
# (`read_base`). "f32_fa" is an f32 cache with flash attention on, which attends as f16.
RUNS = {"f32": ("f32", "off", True), "f32_fa": ("f32", "on", True), "f16": ("f16", "on", True),
        "q8_0": ("q8_0", "on", True), "q4_0": ("q4_0", "on", True),
        "q8_0_plain": ("q8_0", "on", False), "q4_0_plain": ("q4_0", "on", False)}
BASE = "f32"
# ggml's types: (values per block, bytes per block), as ggml/src/ggml.c's type_traits give them
GGML_BLOCKS = {"f32": (1, 4), "f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}
THREADS = 2
STORED_FLOOR = -16.0     # llama.cpp keeps base log-probabilities above max - 16 and skips the rest in the KL


def bytes_per_position(config, cache_type: str) -> float:
    """Bytes one position takes in llama.cpp's cache of `cache_type`: K and V, every layer and KV head."""
    per_block, block_bytes = GGML_BLOCKS[cache_type]
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim / per_block * block_bytes


# ---- the text, the same for both --------------------------------------------------------------------------

def held_out_text(tokenizer, tokens: int, margin: int = 32) -> str:
    """About `tokens` tokens of the held-out plays, an equal part of each (plus `margin` tokens), each part
    starting at the first line a quarter of the way into its play (past the list of characters), the parts
    joined by a blank line. A part ends where its last token ends, so no token is cut."""
    per_play = -(-tokens // len(data.HELD_OUT)) + margin
    parts = []
    for name in data.HELD_OUT:
        body = data.plays()[name]
        start = re.compile(r"^\S", re.M).search(body, len(body) // 4).start()
        chars = body[start:start + 12 * per_play]                       # ample characters for per_play tokens
        part = tokenizer.decode(tokenizer.encode(chars)[:per_play])
        if not chars.startswith(part):
            raise ValueError(f"{name}: the decoded tokens are not a prefix of the text")
        parts.append(part)
    return "\n\n".join(parts)


# ---- llama.cpp's side -------------------------------------------------------------------------------------

def command(model_file, text_file, base_file, ctx: int, chunks: int, cache_type: str, flash: str = "on",
            base: bool = False) -> list:
    """llama-perplexity's command line: `chunks` chunks of `ctx` tokens, each one batch (-b, -ub), flash
    attention `flash` ("on", "off"), THREADS threads pinned to the first cores this process may use, info
    logging (-lv 4: the cache's size and rotation)."""
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[:THREADS]))
    return ["taskset", "-c", cores, str(llamacpp.program("llama-perplexity")), "-m", str(model_file),
            "-f", str(text_file), "-c", str(ctx), "-b", str(ctx), "-ub", str(ctx), "--chunks", str(chunks),
            "-t", str(THREADS), "-fa", flash, "-ctk", cache_type, "-ctv", cache_type, "-lv", "4",
            "--kl-divergence-base", str(base_file), *([] if base else ["--kl-divergence"])]


def run(cmd: list, rotate: bool = True, timeout: float = 900) -> str:
    """Run llama-perplexity with an environment of its own (llamacpp.clean_env); its output, stdout and stderr."""
    env = llamacpp.clean_env(**({} if rotate else {"LLAMA_ATTN_ROT_DISABLE": 1}))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed (exit {done.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return out


NUMBER = r"(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|-?nan|-?inf)"      # an uncertainty of 0 variance prints as nan
PLUS_MINUS = rf"{NUMBER}\s*±\s*{NUMBER}"
KL_LINES = {"kl": rf"Mean\s+KLD:\s*{PLUS_MINUS}", "top1": rf"Same top p:\s*{PLUS_MINUS}\s*%",
            "ppl": rf"Mean PPL\(Q\)\s*:\s*{PLUS_MINUS}", "ppl_base": rf"Mean PPL\(base\)\s*:\s*{PLUS_MINUS}",
            "ln_ppl_ratio": rf"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*{PLUS_MINUS}"}
ONE_NUMBER = {"kl_median": rf"Median\s+KLD:\s*{NUMBER}", "kl_99": rf"99\.0%\s+KLD:\s*{NUMBER}",
              "kl_max": rf"Maximum KLD:\s*{NUMBER}"}


def parse(out: str) -> dict:
    """What a llama-perplexity run printed: with --kl-divergence, "kl" (mean, nats) and its "kl_se", "top1"
    (%, "Same top p") and "top1_se", "ppl", "ppl_base", "ln_ppl_ratio" (each with "_se"), "kl_median",
    "kl_99", "kl_max"; a base run's "ppl" and "ppl_se" (its final estimate); and from either, "chunks",
    "ctx", the cache's "kv_mib" (K and V, as llama.cpp reports it), "rotated" (attn_rot_k and attn_rot_v both
    on), "flash_attn" and the cache's "kv_cells". A value the output does not hold is left out."""
    got = {}
    for name, pattern in KL_LINES.items():
        if m := re.search(pattern, out):
            got[name], got[f"{name}_se"] = finite(m[1]), finite(m[2])
    for name, pattern in ONE_NUMBER.items():
        if m := re.search(pattern, out):
            got[name] = finite(m[1])
    if m := re.search(rf"Final estimate: PPL = {NUMBER} \+/- {NUMBER}", out):
        got["ppl"], got["ppl_se"] = float(m[1]), float(m[2])
    if m := re.search(r"(?:computing|calculating perplexity) over (\d+) chunks, n_ctx=(\d+)", out):
        got["chunks"], got["ctx"] = int(m[1]), int(m[2])
    if m := re.search(rf"llama_kv_cache: size =\s*{NUMBER} MiB \(\s*(\d+) cells", out):
        got["kv_mib"], got["kv_cells"] = float(m[1]), int(m[2])
    rot = re.findall(r"attn_rot_([kv]) = (\d)", out)
    if rot:
        got["rotated"] = all(flag == "1" for _, flag in rot)
    if m := re.search(r"flash_attn\s*=\s*(\w+)", out):
        got["flash_attn"] = m[1]
    return got


def finite(text: str) -> float | None:
    """A number as llama-perplexity printed it; None for nan or inf (JSON holds neither)."""
    x = float(text)
    return x if np.isfinite(x) else None


def read_base(path):
    """A --kl-divergence-base file: (ctx, vocab, ids `[chunks, ctx]` int32, rows `[chunks, ctx/2 - 1, 4 + V']`
    uint16). Per scored position a row holds two float32, a scale and the smallest log-probability kept,
    then one 16-bit code per token: log p = scale * code + smallest (`stored_log_probs`)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(raw[:8]) != b"_logits_":
        raise ValueError(f"{path} is not a llama-perplexity logits file")
    ctx, vocab, chunks = (int(x) for x in raw[8:20].view(np.int32))
    ids = raw[20:20 + 4 * ctx * chunks].view(np.int32).reshape(chunks, ctx)
    n, nv = ctx - 1 - ctx // 2, 2 * ((vocab + 1) // 2) + 4
    rows = raw[20 + 4 * ctx * chunks:].view(np.uint16).reshape(chunks, n, nv)
    return ctx, vocab, ids, rows


def stored_log_probs(rows, vocab: int) -> torch.Tensor:
    """Rows of a base file `[n, 4 + V']` -> the log-probabilities they hold `[n, V]`, float64."""
    rows = np.ascontiguousarray(rows)
    head = rows[:, :4].view(np.float32)                                       # [n, 2]: scale, smallest
    codes = torch.from_numpy(rows[:, 4:4 + vocab].astype(np.float64))
    return codes * torch.from_numpy(head[:, :1].astype(np.float64)) + torch.from_numpy(head[:, 1:2].astype(np.float64))


def stored_kl(base_log_probs, logits) -> torch.Tensor:
    """KL(base || logits) per position, as llama.cpp sums it: over the tokens whose stored log-probability
    is above STORED_FLOOR. base_log_probs, logits `[n, V]` -> `[n]`."""
    q = torch.log_softmax(logits.double(), -1)
    kept = base_log_probs > STORED_FLOOR
    return torch.where(kept, base_log_probs.exp() * (base_log_probs - q), 0.0).sum(-1)


def llamacpp_runs(text_file, workdir, ctx: int, chunks: int, model_file=None, runs=RUNS, progress=True) -> dict:
    """The base run and every run of `runs` on `text_file`: {"base": parse(...), name: parse(...) | {"type"},
    "base_file": where the base logits are, "command": the q8_0 run's command line}."""
    model_file = model_file or llamacpp.model_files()["float32"]
    base_file = Path(workdir) / "base.bin"
    timeout = 120 + 30 * chunks
    cache_type, flash, _ = RUNS[BASE]
    out = {"base": parse(run(command(model_file, text_file, base_file, ctx, chunks, cache_type, flash, base=True),
                             timeout=timeout)), "base_file": base_file}
    for name, (cache_type, flash, rotate) in tqdm(runs.items(), desc="llama.cpp cache types", disable=not progress):
        cmd = command(model_file, text_file, base_file, ctx, chunks, cache_type, flash)
        out[name] = parse(run(cmd, rotate=rotate, timeout=timeout)) | {"type": cache_type}
        if name == "q8_0":                                               # to show: file names, no folders
            out["command"] = " ".join(Path(a).name if os.sep in a else a for a in cmd[3:])
    return out


# ---- the lab's side ---------------------------------------------------------------------------------------

class ReadBackCache(ConcatCache):
    """A float cache that stores each key and value as `read_back(layer, k, v)` returns it, before attention
    reads it: every position, its own included, is attended as the quantized cache would serve it. The
    cache holds float32; `lab_kl` counts the quantized cache's own bytes."""

    def __init__(self, config, read_back, batch_size: int = 1):
        super().__init__(config, batch_size)
        self.read_back = read_back

    def _write(self, layer, k, v):
        super()._write(layer, *self.read_back(layer, k, v))             # [B, H_kv, T, D] each


def float16(layer, k, v):
    """Keys and values rounded to float16 and back: llama.cpp's f16 cache, read back."""
    return k.half().to(k.dtype), v.half().to(v.dtype)


@torch.inference_mode()
def lab_kl(model, chunks, caches: dict, base=None, progress=True) -> dict:
    """The lab's caches on llama.cpp's protocol: chunks `[N, c]` of ids, each in one step through a fresh
    cache, scored at positions c/2 .. c-2 against the float32 cache (ConcatCache). caches: {name:
    QuantizedCache settings}, each read back through `QuantizedCache.round_trip` (its float window set to 0:
    llama.cpp has none), and "float16". Returns {name: {"kl", "kl_se", "top1" (a share), "positions",
    "bytes_per_position"}, "reference": {"loss"}}: the float32 cache's mean loss on the next tokens. base:
    chunk index -> llama.cpp's stored base log-probabilities `[c/2 - 1, V]`; with it "reference" also
    holds "kl_to_base" (KL(base || the float32 cache) per position, as llama.cpp sums it)."""
    w, cfg = model.weights, model.config
    N, c = chunks.shape
    at = torch.arange(c // 2, c - 1)                                     # the scored positions
    quantizers = {name: QuantizedCache(cfg, **(q | dict(residual=0))) for name, q in caches.items()}
    read_backs = {"float16": float16} | {name: q.round_trip for name, q in quantizers.items()}
    kl = {name: [] for name in read_backs}
    top1 = {name: [] for name in read_backs}
    ref_nll, to_base = [], []
    for i, row in enumerate(tqdm(chunks, desc="lab caches, chunks", disable=not progress)):
        ids = row[None]                                                  # [1, c]
        ref = forward_cached(ids, w, cfg, ConcatCache(cfg), logits_at=at)[0]      # [n, V]
        ref_nll.append(torch.nn.functional.cross_entropy(ref.double(), row[at + 1], reduction="none"))
        if base is not None:
            to_base.append(stored_kl(base(i), ref))
        for name, read_back in read_backs.items():
            got = forward_cached(ids, w, cfg, ReadBackCache(cfg, read_back), logits_at=at)[0]
            kl[name].append(kl_divergence(ref, got))
            top1[name].append((got.argmax(-1) == ref.argmax(-1)).double())
    out = {"reference": dict(loss=float(torch.cat(ref_nll).mean()))}
    if base is not None:
        out["reference"]["kl_to_base"] = torch.cat(to_base)
    for name in read_backs:
        x = torch.cat(kl[name])
        out[name] = dict(kl=float(x.mean()), kl_se=float(x.std() / len(x) ** 0.5),
                         top1=float(torch.cat(top1[name]).mean()), positions=len(x))
    out["float16"]["bytes_per_position"] = cache_bytes(cfg, 1, dtype=torch.float16)
    for name, q in caches.items():                                       # the bytes the quantized cache holds
        cache = QuantizedCache(cfg, **(q | dict(residual=0)))
        forward_cached(chunks[:1], w, cfg, cache, last_only=True)
        out[name]["bytes_per_position"] = cache.nbytes() / c
    return out


# ---- both, on the same tokens -----------------------------------------------------------------------------

def compare(model, ctx: int, chunks: int, caches: dict, runs=RUNS, progress=True) -> dict:
    """llama.cpp's `runs` and the lab's `caches` (QuantizedCache settings by name) on `chunks` chunks of `ctx`
    tokens of held-out text: llama.cpp's parsed runs ("llamacpp"), the lab's ("lab"), whether the two
    tokenizers gave the same ids ("tokens_identical", required: a RuntimeError otherwise), how far the
    lab's float32 forward is from llama.cpp's base run ("lab_vs_llamacpp": the KL as llama.cpp computes it
    from its stored log-probabilities), the build, and each side's bytes per position."""
    cfg = model.config
    with tempfile.TemporaryDirectory(prefix="lab-llamacpp-kl-") as tmp:
        text_file = Path(tmp) / "held_out.txt"
        text_file.write_text(held_out_text(model.tokenizer, ctx * chunks))
        cpp = llamacpp_runs(text_file, tmp, ctx, chunks, runs=runs, progress=progress)
        _, vocab, cpp_ids, rows = read_base(cpp.pop("base_file"))
        lab_ids = model.tokenizer.encode(text_file.read_text())
        if cpp_ids.size != ctx * chunks or list(cpp_ids.reshape(-1)) != lab_ids[:ctx * chunks]:
            raise RuntimeError("llama.cpp and the lab tokenized the held-out text differently: the KLs would "
                               "compare different tokens")
        ids = torch.tensor(lab_ids[:ctx * chunks]).view(chunks, ctx)
        lab = lab_kl(model, ids, caches, base=lambda i: stored_log_probs(rows[i], vocab), progress=progress)
        ref = lab.pop("reference")
        between = ref["kl_to_base"]
    for name, r in cpp.items():
        if name in runs:
            r["bytes_per_position"] = bytes_per_position(cfg, r["type"])
    return dict(ctx=ctx, chunks=chunks, positions=chunks * (ctx - 1 - ctx // 2), tokens_identical=True,
                threads=THREADS, build=llamacpp.build_info(), llamacpp=cpp, lab=lab, lab_loss=ref["loss"],
                lab_vs_llamacpp=dict(kl=float(between.mean()), kl_max=float(between.max())),
                f16_bytes=bytes_per_position(cfg, "f16"))


def build_provenance(r) -> dict:
    """{"llamacpp": the build (version, flags) and threads} for a section's provenance; {} where r says why
    it did not run."""
    return {"llamacpp": dict(build=r["build"], threads=r["threads"])} if isinstance(r, dict) else {}


def versions(build: dict) -> str:
    """llama.cpp's version as its build recorded it: "llama.cpp 0.5.0-dev (build 1, commit 0c1e570), from
    llama-cpp-python==0.3.36"."""
    line = next((v for v in build.get("version", []) if v.startswith("version")), "version unknown")
    return f"llama.cpp {line.removeprefix('version: ')}, from {build.get('package', 'an unknown source')}"


def values(r, lab_names=()) -> dict:
    """results.json entries for `compare`'s result r, or NOT_RUN with the reason r gives as a string."""
    if isinstance(r, str):
        return {"types": {name: {"kl": not_run(r, "nats")} for name in RUNS},
                "lab": {name: {"kl": not_run(r, "nats")} for name in ("float16", *lab_names)}}
    cpp, f16 = r["llamacpp"], r["f16_bytes"]
    v = {"versions": value(versions(r["build"]), None, flags=" ".join(r["build"].get("flags", [])),
                           note=f"llama-perplexity -fa on -t {r['threads']}, float32 weights"),
         "chunks": value(r["chunks"], "chunks", note="held-out plays; each chunk's positions c/2 .. c-2 scored, "
                         "as llama-perplexity scores them"),
         "chunk_tokens": value(r["ctx"], "tokens"),
         "positions": value(r["positions"], "positions"),
         "tokens_identical": value(r["tokens_identical"], None,
                                   note="llama.cpp's ids (from its base file) = the lab's"),
         "base_ppl": value(cpp["base"]["ppl"], None, se=cpp["base"]["ppl_se"], note="llama.cpp, f32 cache"),
         "lab_ppl": value(float(np.exp(r["lab_loss"])), None, note="the lab, float32 cache, the same positions"),
         "lab_vs_llamacpp": value(r["lab_vs_llamacpp"]["kl"], "nats", max=r["lab_vs_llamacpp"]["kl_max"],
                                  note="KL(llama.cpp's f32 base || the lab's float32 cache), from llama.cpp's "
                                       "stored 16-bit log-probabilities"),
         "types": {}, "lab": {}}
    for name in RUNS:
        x = cpp[name]
        v["types"][name] = {"kl": value(x["kl"], "nats", se=x["kl_se"], median=x.get("kl_median"), p99=x.get("kl_99")),
                            "top1": value(x["top1"], "%", se=x["top1_se"]),
                            "bytes_per_position": value(x["bytes_per_position"], "bytes", kv_mib=x.get("kv_mib"),
                                                        kv_cells=x.get("kv_cells"),
                                                        note="ggml blocks: K and V, every layer and KV head"),
                            "over_f16": value(x["bytes_per_position"] / f16, "x"),
                            "rotated": value(bool(x.get("rotated")), None, note="Hadamard rotation (attn_rot_k, "
                                                                                 "attn_rot_v), as llama.cpp logged it")}
        if x.get("ln_ppl_ratio") is not None:
            v["types"][name]["ln_ppl_ratio"] = value(x["ln_ppl_ratio"], None, se=x.get("ln_ppl_ratio_se"))
    for name, x in r["lab"].items():
        v["lab"][name] = {"kl": value(x["kl"], "nats", se=x["kl_se"], positions=x["positions"]),
                          "top1": value(100 * x["top1"], "%"),
                          "bytes_per_position": value(x["bytes_per_position"], "bytes",
                                                      note="codes, scales and zero points the cache holds"),
                          "over_f16": value(x["bytes_per_position"] / f16, "x")}
    return v
