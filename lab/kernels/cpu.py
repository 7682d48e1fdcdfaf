"""Paged decode attention on the CPU that reads every page where it lies: a small C++ kernel.

`paged_attention_gather` (reference.py) copies each sequence's pages end to end and attends over the copy. This
kernel makes one pass over the pages with an online softmax per query head (running maximum m, running sum l of
exp(score - m), running weighted sum acc of the values, rescaled whenever m grows). A page's positions are one
contiguous block: a float32 page is read where it lies, a bfloat16 or float16 one is converted first, in the order it
lies (every kv head at once), into a float32 copy; then the query heads that share each kv head use it. For a head
size of 64 or 128 the compiler knows it, and a head's acc stays in registers.

Tasks of one sequence and a run of up to CHUNK positions (whole pages) run on PyTorch's intra-op threads
(`at::parallel_for`: `torch.set_num_threads` applies), and a second loop merges a sequence's tasks by log-sum-exp,
as FlashDecoding does. `cascade_attention_cpu` (cascade.py) runs the same task over the prompt's shared pages with
one query per branch. `_library` compiles the source at the first call (a few seconds).
"""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sysconfig
import weakref
from pathlib import Path

import torch

from . import step
from .checks import check_cascade_inputs, check_paged_inputs

CHUNK = 512        # positions per task: 8 tasks for one sequence of 4,096, partials of a few KiB each
DTYPES = {torch.float32: "float", torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}

SOURCE = r"""
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
"""

# region paged_attention_cpu_kernel
SOURCE += r"""
const float LOWEST = std::numeric_limits<float>::lowest();   // no infinities under -ffast-math

// One task: positions [start, end) of a table but [sinks, lo), a local layer's past (never read),
// for N queries q [N, Hq, D] (N > 1: branches sharing the pages). Per query head hq of N * Hq:
// m[hq] the top score, l[hq] the sum of exp(score - m), acc[hq] the sum of exp(score - m) * value.
template <typename T, int64_t DC>       // DC: the head size when the compiler knows it (64, 128)
void attend_run(const float* q, const T* k_pool, const T* v_pool, const int* table, int64_t start,
                int64_t end, int64_t sinks, int64_t lo, int64_t N, int64_t Hq, int64_t Hkv,
                int64_t head_dim, int64_t P, float* m, float* l, float* acc) {
  const int64_t D = DC ? DC : head_dim, G = Hq / Hkv, row = Hkv * D;  // G query heads per kv head
  constexpr bool F32 = std::is_same_v<T, float>;     // a float32 page is used where it lies
  std::vector<float> s(P), k(F32 ? 0 : P * row), v(F32 ? 0 : P * row);   // scores; a page as floats
  std::fill(m, m + N * Hq, LOWEST), std::fill(l, l + N * Hq, 0.f);
  std::fill(acc, acc + N * Hq * D, 0.f);
  for (int64_t first = start; first < end; first += P) {
    const int64_t n = std::min(P, end - first), page = table[first / P] * P * row;  // [P, Hkv, D]
    if (first >= sinks && first + n <= lo) continue;          // outside the sinks and the window
    const int64_t next = (first + P < end ? table[first / P + 1] : table[first / P]) * P * row;
    // Another dtype's page: its rows, every kv head, read in the order they lie, as floats.
    const float *kp = k.data(), *vp = v.data();
    if constexpr (F32) kp = k_pool + page, vp = v_pool + page;
    else
      for (int64_t at = 0; at < n * row; ++at)
        k[at] = float(k_pool[page + at]), v[at] = float(v_pool[page + at]);
    // The next page lies anywhere, where no prefetcher would guess: ask for it into the L2, a slice
    // per query head below (the L1 holds few misses in flight; a whole page at once waits on them).
    const int64_t lines = (P * row * int64_t(sizeof(T)) + 63) / 64, slices = Hkv * N * G;
    const char *nk = (const char*)(k_pool + next), *nv = (const char*)(v_pool + next);
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t i = 0; i < N * G; ++i) {   // the G query heads of kv head h, of every query
        const int64_t hq = i / G * Hq + h * G + i % G, slice = h * N * G + i;
        for (int64_t line = lines * slice / slices; line < lines * (slice + 1) / slices; ++line)
          __builtin_prefetch(nk + 64 * line, 0, 2), __builtin_prefetch(nv + 64 * line, 0, 2);
        for (int64_t t = 0; t < n; ++t) {     // scores: q . k
          const float* kt = kp + t * row + h * D;   // its key
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += q[hq * D + d] * kt[d];
          s[t] = first + t >= sinks && first + t < lo ? LOWEST : dot;   // a position no query reads
        }
        const float m_new = std::max(m[hq], *std::max_element(s.data(), s.data() + n));
        const float c = std::exp(m[hq] - m_new);      // online softmax: rescale what came before
        for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - m_new);
        float sum = 0.f, o[DC ? DC : 1], *a = DC ? o : acc + hq * D;
        for (int64_t t = 0; t < n; ++t) sum += s[t];
        l[hq] = l[hq] * c + sum, m[hq] = m_new;
        for (int64_t d = 0; d < D; ++d) a[d] = acc[hq * D + d] * c;
        for (int64_t t = 0; t < n; ++t)       // values, weighted
          for (int64_t d = 0; d < D; ++d) a[d] += s[t] * vp[(t * row + h * D) + d];
        if (DC) std::copy(o, o + D, acc + hq * D);
      }
    }
  }
}
"""
# endregion

SOURCE += r"""
template <typename T>
auto run_for(int64_t D) { return D == 64 ? attend_run<T, 64> : D == 128 ? attend_run<T, 128> : attend_run<T, 0>; }

// q [B, Hq, D] (strides sqb, sqh, its rows contiguous) as floats [B, Hq, D], times scale.
template <typename T>
std::vector<float> scaled(const T* q, int64_t sqb, int64_t sqh, float scale, int64_t B, int64_t Hq, int64_t D) {
  std::vector<float> qf(B * Hq * D);
  for (int64_t i = 0; i < B * Hq; ++i)
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] = float(q[i / Hq * sqb + i % Hq * sqh + d]) * scale;
  return qf;
}

// Each sequence's runs of `chunk` positions, one task each: sequence b's query qf[b] [Hq, D] over its table
// and length, into parts [B, runs, Hq * (D + 2)] (a run's m, l, acc).
template <typename T>
void attend_runs(const float* qf, const T* k_pool, const T* v_pool, const int* tables, const int* lengths,
                 float* parts, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t P, int64_t max_pages,
                 int64_t runs, int64_t chunk, int64_t window, int64_t sinks) {
  const int64_t part = Hq * (D + 2);
  const auto run = run_for<T>(D);
  at::parallel_for(0, B * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / runs, start = task % runs * chunk, length = lengths[b];
      const int64_t lo = window ? std::max(int64_t(0), length - window) : 0;
      float* p = parts + task * part;
      run(qf + b * Hq * D, k_pool, v_pool, tables + b * max_pages, std::min(start, length),
          std::min(start + chunk, length), window ? sinks : 0, lo, 1, Hq, Hkv, D, P, p, p + Hq, p + 2 * Hq);
    }
  });
}

// `count` runs' partials, run r's at p + r * stride: m [H], l [H], acc [H, D] for H query heads.
struct Runs { const float* p; int64_t count, stride, H; };

// Head i of the runs a and head j of the runs b (one query head, two sets of positions) merged by
// log-sum-exp into out [D]: each run's l and acc rescaled by exp(m_run - m_max) and added, acc / l.
template <typename T>
void merge(Runs a, int64_t i, Runs b, int64_t j, int64_t D, float* o, T* out) {
  float m = LOWEST, l = 0.f;
  for (auto [x, h] : {std::pair(a, i), std::pair(b, j)})
    for (int64_t r = 0; r < x.count; ++r) m = std::max(m, x.p[r * x.stride + h]);
  std::fill(o, o + D, 0.f);
  for (auto [x, h] : {std::pair(a, i), std::pair(b, j)})
    for (int64_t r = 0; r < x.count; ++r) {
      const float* p = x.p + r * x.stride;
      if (p[x.H + h] == 0.f) continue;               // a run past the sequence's end: nothing in it
      const float c = std::exp(p[h] - m);
      l += c * p[x.H + h];
      for (int64_t d = 0; d < D; ++d) o[d] += c * p[2 * x.H + h * D + d];
    }
  for (int64_t d = 0; d < D; ++d) out[d] = T(o[d] / l);
}

template <typename T>
void attend(const T* q, int64_t sqb, int64_t sqh, float scale, const T* k_pool, const T* v_pool,
            const int* tables, const int* lengths, float* parts, T* out, int64_t B, int64_t Hq, int64_t Hkv,
            int64_t D, int64_t P, int64_t max_pages, int64_t runs, int64_t chunk, int64_t window, int64_t sinks) {
  const auto qf = scaled(q, sqb, sqh, scale, B, Hq, D);
  attend_runs(qf.data(), k_pool, v_pool, tables, lengths, parts, B, Hq, Hkv, D, P, max_pages, runs, chunk,
              window, sinks);
  const int64_t part = Hq * (D + 2);
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {  // merge a sequence's runs
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh)
      merge(Runs{parts + bh / Hq * runs * part, runs, part, Hq}, bh % Hq, Runs{}, 0, D, o.data(), out + bh * D);
  });
}

// N branches of one prompt: the shared pages read once for all N * Hq query heads, in runs of chunk_s
// positions (parts_s [runs_s, N * Hq * (D + 2)]); then each branch's own pages as `attend` reads a
// sequence's (parts [N, runs, Hq * (D + 2)]); a query head's runs of both merged.
template <typename T>
void cascade(const T* q, int64_t sqb, int64_t sqh, float scale, const T* k_pool, const T* v_pool,
             const int* shared, int64_t shared_length, const int* tables, const int* lengths, float* parts_s,
             float* parts, T* out, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t P, int64_t max_pages,
             int64_t runs_s, int64_t chunk_s, int64_t runs, int64_t chunk) {
  const auto qf = scaled(q, sqb, sqh, scale, N, Hq, D);
  const int64_t heads = N * Hq, part_s = heads * (D + 2), part = Hq * (D + 2);
  const auto run = run_for<T>(D);
  at::parallel_for(0, runs_s, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* p = parts_s + r * part_s;
      run(qf.data(), k_pool, v_pool, shared, r * chunk_s, std::min((r + 1) * chunk_s, shared_length), 0, 0, N,
          Hq, Hkv, D, P, p, p + heads, p + 2 * heads);
    }
  });
  attend_runs(qf.data(), k_pool, v_pool, tables, lengths, parts, N, Hq, Hkv, D, P, max_pages, runs, chunk, 0, 0);
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh)
      merge(Runs{parts_s, runs_s, part_s, heads}, bh, Runs{parts + bh / Hq * runs * part, runs, part, Hq}, bh % Hq,
            D, o.data(), out + bh * D);
  });
}

// The fused operations of a decoder layer (fused.py), each rounding to T where the reference does.

// One row: out[d] = weight[d] * T(r[d] / rms(r)) rounded to T, for r [D] floats (T's values); out may be r.
template <typename T, typename Out>
inline void rms_row(const float* r, const T* w, int64_t D, float eps, Out* out) {
  float ss = 0.f;
  for (int64_t d = 0; d < D; ++d) ss += r[d] * r[d];
  const float inv = 1.f / std::sqrt(ss / float(D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = Out(T(float(w[d]) * float(T(r[d] * inv))));
}

// Row n of x [N, D] (row stride sx) plus row n of add (stride sa), rounded to T, into sum [N, D] (with no
// add: x itself, and sum is not written); out [N, D] = weight * T(sum / rms(sum)), statistics in float32.
template <typename T>
void add_rms_norm(const T* x, int64_t sx, const T* add, int64_t sa, const T* w, T* sum, T* out,
                  int64_t N, int64_t D, float eps) {
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> r(D);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t d = 0; d < D; ++d) {
        const T v = add ? T(float(x[n * sx + d]) + float(add[n * sa + d])) : x[n * sx + d];
        if (add) sum[n * D + d] = v;
        r[d] = float(v);
      }
      rms_row(r.data(), w, D, eps, out + n * D);
    }
  });
}

template <typename T>
inline void rope_head(T* h, const T* c, const T* s, int64_t D) {    // one head [D] of one row
  for (int64_t j = 0; j < D / 2; ++j) {
    const float a = float(h[j]), b = float(h[j + D / 2]);
    h[j] = T(float(T(a * float(c[j]))) - float(T(b * float(s[j]))));
    h[j + D / 2] = T(float(T(b * float(c[j + D / 2]))) + float(T(a * float(s[j + D / 2]))));
  }
}

// RoPE in place on the H heads of every row of x [N, H * D] (row stride sx): the pairs (j, j + D/2)
// turned by the angles of row n, cos and sin [N, D].
template <typename T>
void rope(T* x, int64_t sx, const T* cos, const T* sin, int64_t N, int64_t H, int64_t D) {
  at::parallel_for(0, N * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rope_head(x + i / H * sx + i % H * D, cos + i / H * D, sin + i / H * D, D);
  });
}

// Rows x[n] [H, D] (token stride sn, head stride sh) into rows slots[n] of pool [S, H, D]: a step's keys
// or values into their pages.
template <typename T>
void store(const T* x, int64_t sn, int64_t sh, T* pool, const int64_t* slots, int64_t N, int64_t H, int64_t D) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) std::memcpy(pool + (slots[n] * H + h) * D, x + n * sn + h * sh, D * sizeof(T));
}

template <typename T>
inline T silu_mul_one(T gate, T up) {                // one value: T(silu(gate)) * up, rounded as the reference
  const float g = float(gate);
  return T(float(T(g / (1.f + std::exp(-g)))) * float(up));
}

// out [N, F] = T(silu(gate)) * up, gate and up [N, F] with row strides sg, su.
template <typename T>
void silu_mul(const T* gate, int64_t sg, const T* up, int64_t su, T* out, int64_t N, int64_t F) {
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t f = 0; f < F; ++f) out[n * F + f] = silu_mul_one(gate[n * sg + f], up[n * su + f]);
  });
}

// The weights' fingerprint (lab/models/checks.py) in one call: from tensor i at addr[i], runs[i]
// runs of run[i] bytes, step[i] bytes apart, copied one after another into out. Between two serving
// steps the weights have left the processor's caches and the runs lie megabytes apart, each a miss
// of its own: every run is asked for first, so that their misses overlap; then they are copied.
extern "C" void sample_runs(const int64_t* addr, const int64_t* run, const int64_t* step, const int64_t* runs,
                            int64_t count, char* out) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t r = 0; r < runs[i]; ++r) __builtin_prefetch((const char*)addr[i] + r * step[i]);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t r = 0; r < runs[i]; ++r, out += run[i]) std::memcpy(out, (const char*)addr[i] + r * step[i], run[i]);
}
"""

# The entry points: under a C name per operation and dtype (attend_float32 = &attend<float>, ...),
# the address of the template's instance, which `_library` reads and calls with these arguments.
I64, PTR, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = {"attend": [PTR, I64, I64, F32] + [PTR] * 6 + [I64] * 10,
              "cascade": [PTR, I64, I64, F32, PTR, PTR, PTR, I64] + [PTR] * 5 + [I64] * 10,
              "add_rms_norm": [PTR, I64, PTR, I64, PTR, PTR, PTR, I64, I64, F32],
              "rope": [PTR, I64, PTR, PTR, I64, I64, I64],
              "silu_mul": [PTR, I64, PTR, I64, PTR, I64, I64],
              "store": [PTR, I64, I64, PTR, PTR, I64, I64, I64],
              "step": [PTR, PTR, I64] + [PTR] * 6 + [I64, PTR, PTR, I64, PTR, I64, PTR] + [I64] * 8 + [F32, I64, I64]}
SOURCE += step.SOURCE                # a whole decode step in one call (step.py), built from the functions above
SOURCE += "".join(f'extern "C" {{ auto {op}_{str(t).removeprefix("torch.")} = &{op}<{c}>; }}\n'
                  for op in SIGNATURES for t, c in DTYPES.items())

# Compiler flags. -march=native: this processor's vector instructions (a build is cached per
# processor), 512-bit vectors where it has them. -ffast-math lets the compiler reorder the float
# sums (to vectorize the dot products) and call the vectorized exp. Given to the compile step only:
# linked with it, GCC 12 adds start-up code that sets flush-to-zero for the whole process. -fopenmp:
# at::parallel_for runs on OpenMP threads only when compiled with it (else on one thread); libgomp
# then resolves to the copy PyTorch has already loaded, so torch.set_num_threads applies.
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
    """Compile SOURCE with $CXX (default c++) against PyTorch's headers for its thread pool and 16-bit floats only,
    cache it under $LAB_KERNEL_CACHE (default ~/.cache/lab/kernels), and load it. Raises KernelBuildError."""
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
    for op, args in SIGNATURES.items():
        for dtype in DTYPES:
            name = f"{op}_{str(dtype).removeprefix('torch.')}"
            setattr(lib, name, ctypes.CFUNCTYPE(None, *args)(PTR.in_dll(lib, name).value))
    lib.sample_runs.argtypes, lib.sample_runs.restype = [PTR] * 4 + [I64, PTR], None
    return lib


def _call(op: str, *args) -> None:
    """Call the library's `op` for args[0]'s dtype (attend_float32, ...), tensors as addresses."""
    fn = getattr(_library(), f"{op}_{str(args[0].dtype).removeprefix('torch.')}")
    fn(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))


@functools.cache
def cpu_kernel_available() -> bool:
    """Whether the C++ kernel builds and loads here (`decode_attention` falls back to the gather if not)."""
    try:
        _library()
    except KernelBuildError:
        return False
    return True


def paged_attention_cpu(q, k_pool, v_pool, block_tables, lengths, scale=None, check_values=True,
                        max_length=None, window: int = 0, sinks: int = 0):
    """Decode attention over pages read in place, in C++ (see the module docstring): q [B, H_q, D] (any strides)
    and pools [num_pages, page_size, H_kv, D] float32, bfloat16 or float16 on the CPU, block_tables int32 [B,
    max_pages], lengths int32 [B] -> [B, H_q, D] in q's dtype (float32 inside). max_length: the longest of lengths,
    if known on the host; window, sinks: a local layer's rule (chapter 10), pages wholly outside it never read."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, lengths, check_values, window, sinks)
    q, k_pool, v_pool, block_tables, lengths = _cpu_inputs(
        "paged_attention_cpu", "decode_attention", q, k_pool, v_pool, block_tables, lengths)
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    scale = D ** -0.5 if scale is None else float(scale)
    chunk = max(CHUNK // page_size, 1) * page_size                  # whole pages per task
    runs = -(-int(lengths.max() if max_length is None else max_length) // chunk)   # tasks per sequence
    parts = torch.empty(B, runs, H_q * (D + 2))                     # each task's m [H_q], l [H_q], acc [H_q, D]
    out = torch.empty(B, H_q, D, dtype=q.dtype)                     # [B, H_q, D]
    _call("attend", q, q.stride(0), q.stride(1), scale, k_pool, v_pool, block_tables, lengths,
          parts, out, B, H_q, H_kv, D, page_size, block_tables.shape[1], runs, chunk, window, sinks)
    return out


def _cpu_inputs(name, chooser, q, *tensors) -> tuple:
    """q with contiguous rows and `tensors` contiguous (no-ops for a cache's pools and tables);
    ValueError unless q is on the CPU, TypeError unless of a dtype the kernel `name` takes."""
    if q.device.type != "cpu":
        raise ValueError(f"{name} runs on CPU tensors, got {q.device}; {chooser} chooses a kernel for the device")
    if q.dtype not in DTYPES:
        raise TypeError(f"{name} takes {', '.join(map(str, DTYPES))}, got {q.dtype}")
    return q if q.stride(-1) == 1 else q.contiguous(), *(t.contiguous() for t in tensors)


def cascade_attention_cpu(q, k_pool, v_pool, shared_table, shared_length: int, block_tables, lengths, scale=None,
                          check_values=True, max_length=None):
    """Decode attention for B branches of one prompt (arguments in cascade.py; max_length as for
    `paged_attention_cpu`), in C++: the shared pages in runs cut so that every thread has some, each
    read once for all branches, then each branch's own pages. Returns [B, H_q, D] in q's dtype."""
    check_cascade_inputs(q, k_pool, v_pool, shared_table, shared_length, block_tables, lengths, check_values)
    q, k_pool, v_pool, tables, lengths, shared_table = _cpu_inputs(
        "cascade_attention_cpu", "cascade_attention", q, k_pool, v_pool, block_tables, lengths,
        shared_table)
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    per_thread = -(-len(shared_table) // torch.get_num_threads())  # shared pages per thread
    chunk_s = max(min(CHUNK // page_size, per_thread), 1) * page_size     # whole pages per shared run
    chunk = max(CHUNK // page_size, 1) * page_size
    runs_s = -(-shared_length // chunk_s)
    runs = -(-int(lengths.max() if max_length is None else max_length) // chunk)
    parts_s = torch.empty(runs_s, B * H_q * (D + 2))               # each shared run's m, l, acc for all B * H_q
    parts = torch.empty(B, runs, H_q * (D + 2))                    # each own run's m [H_q], l [H_q], acc [H_q, D]
    out = torch.empty(B, H_q, D, dtype=q.dtype)                     # [B, H_q, D]
    scale = D ** -0.5 if scale is None else float(scale)
    _call("cascade", q, q.stride(0), q.stride(1), scale, k_pool, v_pool, shared_table,
          shared_length, tables, lengths, parts_s, parts, out, B, H_q, H_kv, D, page_size,
          tables.shape[1], runs_s, chunk_s, runs, chunk)
    return out


_plans = {}      # (samples, run) -> the last plan: weak references to its tensors, their addresses and sizes,
                 # the table of runs, the sample's bytes


def sample_runs(tensors, samples: int, run: int) -> bytes | None:
    """The fingerprint's sample (lab/models/checks.py) in one call: the raw bytes of `samples`
    elements of each tensor, in runs of `run` consecutive ones evenly spaced over it (all of a
    smaller tensor), one tensor after another. None when the kernel is not built or a tensor is not
    a contiguous CPU tensor: the caller samples in PyTorch, to the same bytes. The table of runs is
    kept for the same tensors at the same addresses and sizes (a serving engine asks once per step):
    on SmolLM2's 272 tensors, finding it took about 55 us and building it about 280 us."""
    if not cpu_kernel_available():
        return None
    where = [(t.data_ptr(), t.numel()) for t in tensors]
    plan = _plans.get((samples, run))
    if plan is None or plan[1] != where or any(r() is not t for r, t in zip(plan[0], tensors, strict=True)):
        rows = []                                 # per tensor: address, run and step in bytes, runs
        for t, (address, n) in zip(tensors, where, strict=True):
            if t.device.type != "cpu" or not t.is_contiguous():
                return None
            size = t.element_size()
            k = 1 if n <= samples else samples // run               # runs in this tensor
            rows.append((address, size * (n if k == 1 else run), size * (n // k), k))
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).T.contiguous()  # [4, tensors]
        nbytes = int((table[1] * table[3]).sum())
        plan = _plans[samples, run] = ([weakref.ref(t) for t in tensors], where, table, nbytes)
    table = plan[2]
    out = torch.empty(plan[3], dtype=torch.uint8)
    _library().sample_runs(*(row.data_ptr() for row in table), table.shape[1], out.data_ptr())
    return out.numpy().tobytes()
