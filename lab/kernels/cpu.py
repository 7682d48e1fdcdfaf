"""Paged decode attention on the CPU that reads every page where it lies: a small C++ kernel.

`paged_attention_gather` (reference.py) copies each sequence's pages end to end, then attends over the
copy: that writes every byte of keys and values once more and reads it back. This kernel makes one pass
over the pages instead. For each sequence it walks the block table page by page and keeps, per query
head, an online softmax: the running maximum score m, the running sum l of exp(score - m) and the running
weighted sum acc of the values, rescaled whenever m grows. A page holds its positions one after another,
each position all its kv heads, so a page is one contiguous block of memory, read once.

Work is split into tasks of one sequence and a run of up to CHUNK positions (whole pages), run on
PyTorch's intra-op threads (`at::parallel_for`, so `torch.set_num_threads` applies); a long sequence
alone still keeps every thread busy. Each task leaves its (m, l, acc); a second loop merges a sequence's
tasks by log-sum-exp, as FlashDecoding does on a GPU.

The source is compiled at the first call with the system's C++ compiler (`c++`, or $CXX), against
PyTorch's headers for its thread pool and its 16-bit float types only (a few seconds, not the half
minute a full PyTorch extension takes), and cached under ~/.cache/lab/kernels (or $LAB_KERNEL_CACHE),
keyed by the source, the flags, PyTorch's version and the processor. It is called through ctypes:
pointers in, float32 out.
"""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sysconfig
from pathlib import Path

import torch

from .checks import check_paged_inputs

CHUNK = 512        # positions per task: 8 tasks for one sequence of 4,096, partials of a few KiB each
DTYPES = {torch.float32: "float", torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}

# region paged_attention_cpu_kernel
SOURCE = r"""
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

const float LOWEST = std::numeric_limits<float>::lowest();   // no infinities under -ffast-math

// One task: sequence b, positions [start, end). For each query head hq: m[hq] the largest score,
// l[hq] the sum of exp(score - m), acc[hq] the sum of exp(score - m) * value (D floats).
template <typename T>
void attend_run(const float* q, const T* k_pool, const T* v_pool, const int* table,
                int64_t start, int64_t end, int64_t Hq, int64_t Hkv, int64_t D, int64_t P,
                float* m, float* l, float* acc) {
  const int64_t G = Hq / Hkv, row = Hkv * D;         // query heads per kv head; floats per position
  std::vector<float> s(Hq * P);                       // one page's scores, then its weights
  std::fill(m, m + Hq, LOWEST), std::fill(l, l + Hq, 0.f);
  std::fill(acc, acc + Hq * D, 0.f);
  for (int64_t first = start; first < end; first += P) {
    const int64_t n = std::min(P, end - first), page = table[first / P];
    const T* k = k_pool + page * P * row;             // the page where it lies: [P, Hkv, D]
    const T* v = v_pool + page * P * row;
    if (first + P < end) {      // the next page lies anywhere, where no prefetcher would guess:
      const int64_t next = table[first / P + 1] * P * row;    // ask for it while this one is read
      const char* nk = (const char*)(k_pool + next);
      const char* nv = (const char*)(v_pool + next);
      for (int64_t byte = 0; byte < P * row * int64_t(sizeof(T)); byte += 64)
        __builtin_prefetch(nk + byte), __builtin_prefetch(nv + byte);
    }
    for (int64_t t = 0; t < n; ++t)                   // scores: q . k for every head and position
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const float* qh = q + hq * D;
        const T* kh = k + t * row + hq / G * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * float(kh[d]);
        s[hq * P + t] = dot;
      }
    for (int64_t hq = 0; hq < Hq; ++hq) {             // online softmax: rescale what came before
      float* sh = s.data() + hq * P;
      const float m_new = std::max(m[hq], *std::max_element(sh, sh + n));
      const float c = std::exp(m[hq] - m_new);
      l[hq] *= c;
      for (int64_t d = 0; d < D; ++d) acc[hq * D + d] *= c;
      for (int64_t t = 0; t < n; ++t) sh[t] = std::exp(sh[t] - m_new), l[hq] += sh[t];
      m[hq] = m_new;
    }
    for (int64_t t = 0; t < n; ++t)                   // values, weighted
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const float w = s[hq * P + t];
        const T* vh = v + t * row + hq / G * D;
        for (int64_t d = 0; d < D; ++d) acc[hq * D + d] += w * float(vh[d]);
      }
  }
}
"""
# endregion

SOURCE += r"""
template <typename T>
void attend(const float* q, const T* k_pool, const T* v_pool, const int* tables, const int* lengths,
            float* parts, float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t P,
            int64_t max_pages, int64_t runs, int64_t chunk) {
  const int64_t part = Hq * (D + 2);                  // parts [B, runs, Hq * (D + 2)]: m, l, acc
  at::parallel_for(0, B * runs, 1, [&](int64_t begin, int64_t end_) {
    for (int64_t task = begin; task < end_; ++task) {
      const int64_t b = task / runs, start = task % runs * chunk;
      float* p = parts + task * part;
      attend_run(q + b * Hq * D, k_pool, v_pool, tables + b * max_pages, std::min(start, int64_t(lengths[b])),
                 std::min(start + chunk, int64_t(lengths[b])), Hq, Hkv, D, P, p, p + Hq, p + 2 * Hq);
    }
  });
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end_) {  // merge a sequence's runs
    for (int64_t bh = begin; bh < end_; ++bh) {
      const int64_t b = bh / Hq, hq = bh % Hq;
      const float* first = parts + b * runs * part;
      float m = LOWEST, l = 0.f;
      for (int64_t r = 0; r < runs; ++r) m = std::max(m, first[r * part + hq]);
      float* o = out + bh * D;
      std::fill(o, o + D, 0.f);
      for (int64_t r = 0; r < runs; ++r) {
        const float* p = first + r * part;
        if (p[Hq + hq] == 0.f) continue;              // a run past the sequence's end: nothing in it
        const float c = std::exp(p[hq] - m);
        l += c * p[Hq + hq];
        for (int64_t d = 0; d < D; ++d) o[d] += c * p[2 * Hq + hq * D + d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= l;
    }
  });
}
"""

SOURCE += "".join(f"""
extern "C" void attend_{name}(const float* q, const void* k, const void* v, const int* tables,
                              const int* lengths, float* parts, float* out, int64_t B, int64_t Hq,
                              int64_t Hkv, int64_t D, int64_t P, int64_t max_pages, int64_t runs,
                              int64_t chunk) {{
  attend(q, (const {ctype}*)k, (const {ctype}*)v, tables, lengths, parts, out, B, Hq, Hkv, D, P, max_pages,
         runs, chunk);
}}
""" for name, ctype in ((str(t).removeprefix("torch."), c) for t, c in DTYPES.items()))


# Compiler flags. -march=native: this processor's vector instructions (so a build is cached per
# processor), 512-bit vectors where it has them. -ffast-math lets the compiler reorder the float sums
# (to vectorize the dot products) and call the vectorized exp; it also assumes no infinities, so the
# kernel starts its running maxima at the lowest finite float. It is given to the compile step only:
# linked with it, GCC 12 adds start-up code that sets flush-to-zero for the whole process.
# -fopenmp: at::parallel_for runs its loop on OpenMP threads only when compiled with OpenMP (without it, on
# one thread); libgomp then resolves to the copy PyTorch has already loaded, so torch.set_num_threads applies
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC", "-DNDEBUG"]
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS.append("-mprefer-vector-width=512")      # used only where the processor has AVX-512


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded (no C++ compiler, or it failed)."""


def _cpu_name() -> str:
    """The processor's model name (the build uses -march=native, so a cached build is per processor)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run(cmd):
    """Run one compiler command; KernelBuildError if it cannot start or fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise KernelBuildError(f"cannot run the C++ compiler {cmd[0]!r} (set $CXX): {e}") from e
    if done.returncode != 0:
        raise KernelBuildError(f"building the CPU paged-attention kernel failed:\n{' '.join(cmd)}\n"
                               f"{done.stderr[-4000:]}")


@functools.cache
def _library():
    """Compile SOURCE (once per machine: the shared library is cached) and load it. Raises KernelBuildError."""
    torch_dir = Path(torch.__file__).parent
    flags = FLAGS + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
    key = hashlib.sha256("\n".join([SOURCE, *flags, torch.__version__, _cpu_name()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LAB_KERNEL_CACHE", Path.home() / ".cache" / "lab" / "kernels"))
    path = cache / f"paged_attention_cpu_{key}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        stem = path.with_suffix(f".{os.getpid()}")   # per process: parallel test workers may build at once
        src, obj, tmp = (stem.with_suffix(stem.suffix + ext) for ext in (".cpp", ".o", ".tmp"))
        src.write_text(SOURCE)
        cxx = os.environ.get("CXX", "c++")
        _run([cxx, *flags, f"-I{torch_dir / 'include'}", "-c", str(src), "-o", str(obj)])
        _run([cxx, "-shared", "-fopenmp", str(obj), "-o", str(tmp), f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10",
              f"-Wl,-rpath,{torch_dir / 'lib'}"])
        tmp.replace(path)                             # atomic: another process never loads half a file
        src.unlink(), obj.unlink()
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for dtype in DTYPES:
        fn = getattr(lib, f"attend_{str(dtype).removeprefix('torch.')}")
        fn.argtypes, fn.restype = [ptr] * 7 + [i64] * 8, None
    return lib


@functools.cache
def cpu_kernel_available() -> bool:
    """Whether the C++ kernel builds and loads here (`decode_attention` falls back to the gather if not)."""
    try:
        _library()
    except KernelBuildError:
        return False
    return True


def paged_attention_cpu(q, k_pool, v_pool, block_tables, lengths, scale=None, check_values=True):
    """Decode attention over pages read in place, in C++ (see the module docstring). Returns [B, H_q, D].

    q [B, H_q, D] and the pools [num_pages, page_size, H_kv, D] float32, bfloat16 or float16, on the
    CPU; block_tables int32 [B, max_pages]; lengths int32 [B]. Accumulates in float32 and returns q's
    dtype. Pools that are not contiguous are copied first (a PagedCache's never are).
    """
    check_paged_inputs(q, k_pool, v_pool, block_tables, lengths, check_values)
    if q.device.type != "cpu":
        raise ValueError(f"paged_attention_cpu runs on CPU tensors, got {q.device}; decode_attention "
                         f"chooses a kernel for the device")
    if q.dtype not in DTYPES:
        raise TypeError(f"paged_attention_cpu takes {', '.join(map(str, DTYPES))}, got {q.dtype}")
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    scale = D ** -0.5 if scale is None else scale
    q32 = (q.float() * scale).contiguous()                          # [B, H_q, D], scaled once
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()       # no-ops for a cache's pools
    block_tables, lengths = block_tables.contiguous(), lengths.contiguous()
    chunk = max(CHUNK // page_size, 1) * page_size                  # whole pages per task
    runs = -(-int(lengths.max()) // chunk)                          # tasks per sequence
    parts = torch.empty(B, runs, H_q * (D + 2))                     # each task's m [H_q], l [H_q], acc [H_q, D]
    out = torch.empty(B, H_q, D)                                    # [B, H_q, D] float32
    fn = getattr(_library(), f"attend_{str(q.dtype).removeprefix('torch.')}")
    fn(q32.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr(), lengths.data_ptr(),
       parts.data_ptr(), out.data_ptr(), B, H_q, H_kv, D, page_size, block_tables.shape[1], runs, chunk)
    return out.to(q.dtype)
