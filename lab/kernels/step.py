"""A whole decode step of a Llama-shaped model in one C++ call: the serving engine's fast path on the CPU.

A decode step of one sequence multiplies every weight matrix by one vector, so it cannot take less than the
weights' bytes over the machine's read bandwidth (chapter 3's roofline). The reference step (`forward_cached`
through `llama.fused_block`) makes about a dozen calls per layer, and each product wakes the thread pool, splits
the matrix, and waits for the last thread before the next call starts. With 30 layers that is 121 products,
the head's included, of a few hundred kilobytes to a few megabytes each, and between them the threads sleep.

This kernel runs the step's 30 layers and the head inside one OpenMP parallel region, as llama.cpp does. Each
thread takes a fixed share of the rows of every matrix, reads them in the order they lie (asking for the row
AHEAD bytes on while it reads this one), and meets the others at a barrier only where the next operation needs
every row of the last:

    per layer: h = RMSNorm(x)                  every thread, all of it (D values: cheaper than waiting)
               q, k, v = h Wq, h Wk, h Wv      rows shared out                        | barrier
               RoPE(q, k); k, v -> their slots one head per thread                    | barrier
               attention over the pages        runs of CHUNK positions per thread     | barrier
               merge the runs (log-sum-exp)    one query head per thread              | barrier
               x += attn Wo                    rows shared out                        | barrier
               h = RMSNorm(x); a = SiLU(h Wgate) * (h Wup)   rows shared out          | barrier
               x += a Wdown                    rows shared out                        | barrier
    then:      logits = RMSNorm(x) Whead       rows shared out

The products take a matrix four rows at a time. With AVX-512, a tile of four rows times up to four sequences keeps
its sixteen sums in registers, 16 lanes each: each vector of the weights is read once for four sequences, each of
the sequences' once for four rows, and even one sequence has four sums in flight (a single sum would wait on the
latency of each multiply-add before the next). A sequence's four sums are folded together once, at the end of the
rows. While a tile reads its rows, it asks for the same vectors of the rows AHEAD bytes on, one at a time, so that
the prefetches do not queue behind each other. With more than four sequences a tile reads its rows once for every
four (from the L1 cache after the first pass), and each pass asks for a share of the rows ahead: asked for all in
the first pass, they came late, the core waited on the weights' first reads and then computed with the memory idle.
The loop over whole vectors loads them unmasked and the last, partial vector is read masked after it: with the mask
computed inside the loop, GCC kept the sixteen sums in memory as well and stored them at every step. On the Intel
Xeon where the tiles were written, in float32, they made a step of 16 sequences at 128 positions 5-30% faster than
the reference step's oneDNN products (the rounds of two runs), and a step of one sequence about 10% faster than
reading a row at a time (`row_dots`, which serves the last rows of a share and processors without AVX-512). The
shared prefetches and the unmasked loop then made the C++ call of 16 sequences' step about 1.5 times as fast
(35-38 ms against 53-55, about 50 positions, three runs of each; each change alone: 46-49 and 43-44 ms), and one
sequence's no slower. In bfloat16, with AVX-512 BF16, one instruction (vdpbf16ps) multiplies 32 pairs of bfloat16
values and adds them to 16 float32 sums.

Attention is `attend_run` and `merge` from cpu.py, the kernel the engine's reference step calls; the norm, RoPE and
SiLU are cpu.py's row functions, so every value is rounded to the weights' dtype exactly where the reference rounds
it. The products accumulate in float32, as oneDNN's do, in another order: the logits agree with the reference's to
float32's rounding (bfloat16's, in bfloat16), tests/test_step_kernel.py checks how closely.
`lab/engine/fast.py` calls it; chapter 3 measures what it buys.
"""

CHUNK = 128    # positions per attention task: 4 tasks at 512 positions, so that both threads have work
AHEAD = 8192   # bytes: rows this far on (at least four rows on) are asked for, into the L2 cache, while these
               # are read (into the L1, one sequence's float32 step took about 10% longer)
ROWS = 16      # sequences per call at most (fast.py): with 32 or more, the reference step's matrix products
               # (oneDNN's, blocked for many rows) were as fast or faster

# region decode_step_kernel
SOURCE = f"constexpr int64_t ROWS = {ROWS}, AHEAD = {AHEAD};\n" + r"""
#include <omp.h>
#include <type_traits>
#include <utility>

// Row w [K] times NB rows of x [NB, K] (floats, row stride K), into out [NB]: 16 lanes per row and A partial
// sums along K per row, so that at least four independent sums are in flight (one sum would wait on the
// latency of every multiply-add before the next).
template <typename T, int NB, int A = (NB >= 4 ? 1 : 4 / NB)>
inline void dots(const T* w, int64_t K, const float* x, float* out) {
  float acc[NB][A][16] = {};
  const int64_t main = K / (16 * A) * (16 * A);
  for (int64_t k = 0; k < main; k += 16 * A)
    for (int a = 0; a < A; ++a)
      for (int j = 0; j < 16; ++j) {
        const float wk = float(w[k + a * 16 + j]);
        for (int b = 0; b < NB; ++b) acc[b][a][j] += wk * x[b * K + k + a * 16 + j];
      }
  for (int b = 0; b < NB; ++b) {
    float sum = 0.f;
    for (int a = 0; a < A; ++a)
      for (int j = 0; j < 16; ++j) sum += acc[b][a][j];
    for (int64_t k = main; k < K; ++k) sum += float(w[k]) * x[b * K + k];
    out[b] = sum;
  }
}

#ifdef __AVX512BF16__
#include <immintrin.h>
// dots for bfloat16 on a processor with AVX-512 BF16: x [NB, K] as bfloat16 too, and one instruction
// (vdpbf16ps) multiplies 32 pairs and adds each lane's two products to its float32 sum. A product of two
// bfloat16 values is exact in float32, so only the sums round, as in `dots`.
template <int NB, int A = (NB >= 4 ? 1 : 4 / NB)>
inline void dots_bf16(const c10::BFloat16* w, int64_t K, const c10::BFloat16* x, float* out) {
  __m512 acc[NB][A];
  for (int b = 0; b < NB; ++b)
    for (int a = 0; a < A; ++a) acc[b][a] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * A <= K; k += 32 * A)
    for (int a = 0; a < A; ++a) {
      const auto wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * a);
      for (int b = 0; b < NB; ++b)
        acc[b][a] = _mm512_dpbf16_ps(acc[b][a], wv, (__m512bh)_mm512_loadu_si512(x + b * K + k + 32 * a));
    }
  for (; k + 32 <= K; k += 32) {
    const auto wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int b = 0; b < NB; ++b)
      acc[b][0] = _mm512_dpbf16_ps(acc[b][0], wv, (__m512bh)_mm512_loadu_si512(x + b * K + k));
  }
  for (int b = 0; b < NB; ++b) {
    for (int a = 1; a < A; ++a) acc[b][0] = _mm512_add_ps(acc[b][0], acc[b][a]);
    float sum = _mm512_reduce_add_ps(acc[b][0]);
    for (int64_t j = k; j < K; ++j) sum += float(w[j]) * float(x[b * K + j]);
    out[b] = sum;
  }
}
#endif

// Row w [K] (row-major, as nn.Linear stores a matrix) times each of the B rows of x [B, K], into out [B],
// four rows of x at a time. xt: x in T (the same values), for the bfloat16 dot product.
template <typename T>
inline void row_dots(const T* w, int64_t K, const float* x, const T* xt, int64_t B, float* out) {
  for (int64_t b = 0; b < B; b += 4) {
    const int64_t n = std::min(B - b, int64_t(4));
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const T* xb = xt + b * K;
      if (n == 4) dots_bf16<4>(w, K, xb, out + b);
      else if (n == 3) dots_bf16<3>(w, K, xb, out + b);
      else if (n == 2) dots_bf16<2>(w, K, xb, out + b);
      else dots_bf16<1>(w, K, xb, out + b);
      continue;
    }
#endif
    const float* xb = x + b * K;
    if (n == 4) dots<T, 4>(w, K, xb, out + b);
    else if (n == 3) dots<T, 3>(w, K, xb, out + b);
    else if (n == 2) dots<T, 2>(w, K, xb, out + b);
    else dots<T, 1>(w, K, xb, out + b);
  }
}

#ifdef __AVX512F__
#include <immintrin.h>
// The sums of the 16 lanes of a, b, c and d, as [a, b, c, d]: 13 shuffles and adds, where four horizontal
// sums take about 32.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));   // per 128 bits:
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));   // a b a b, c d c d
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),      // a b c d
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// A tile: four rows of w [4, K] (row stride K) times NB rows of x [NB, K], into out [NB, 4]. Its 4 x NB sums
// stay in registers, so that each vector of w and of x is read once per tile; the last vector of a row is read
// masked, after the loop (a mask in the loop kept the sums in memory too). The same vectors of the first `na` rows
// at `ahead` (row stride K) are asked for as these are read.
template <typename T, int NB>
inline void tile(const T* w, const T* ahead, int na, int64_t K, const float* x, const T* xt, float* out) {
  __m512 acc[NB][4];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < 4; ++j) acc[b][j] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    auto at = [&](int64_t k, auto load) {      // the 16 columns from k
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = load(w + j * K + k);
      for (int j = 0; j < 4; ++j)
        if (j < na) __builtin_prefetch(ahead + j * K + k, 0, 2);
      for (int b = 0; b < NB; ++b) {
        const __m512 xv = load(x + b * K + k);
        for (int j = 0; j < 4; ++j) acc[b][j] = _mm512_fmadd_ps(wv[j], xv, acc[b][j]);
      }
    };
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) at(k, [](const float* p) { return _mm512_loadu_ps(p); });
    if (k < K) at(k, [m = __mmask16((1u << (K - k)) - 1)](const float* p) { return _mm512_maskz_loadu_ps(m, p); });
  } else {
#ifdef __AVX512BF16__
    auto at = [&](int64_t k, auto load) {      // 32 pairs from k, into 16 float32 sums (dots_bf16)
      __m512bh wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = load(w + j * K + k);
      for (int j = 0; j < 4; ++j)
        if (j < na) __builtin_prefetch(ahead + j * K + k, 0, 2);
      for (int b = 0; b < NB; ++b) {
        const __m512bh xv = load(xt + b * K + k);
        for (int j = 0; j < 4; ++j) acc[b][j] = _mm512_dpbf16_ps(acc[b][j], wv[j], xv);
      }
    };
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) at(k, [](const T* p) { return (__m512bh)_mm512_loadu_si512(p); });
    if (k < K)
      at(k, [m = __mmask32((1ull << (K - k)) - 1)](const T* p) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); });
#endif
  }
  for (int b = 0; b < NB; ++b) _mm_storeu_ps(out + b * 4, sum4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]));
}
#endif

// Whether `tile` serves T on this processor: float32 with AVX-512, bfloat16 with AVX-512 BF16 as well.
template <typename T>
constexpr bool tiled() {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#elif defined(__AVX512F__)
  return std::is_same_v<T, float>;
#else
  return false;
#endif
}

// Rows w [nw, K] (nw <= 4, row stride K) times the B rows of x [B, K], into out [B, 4]; the nw rows at `ahead`
// (or none: null) asked for meanwhile, as the prefetcher cannot guess them, into the L2 cache (locality 2).
template <typename T>
inline void block_dots(const T* w, int nw, const T* ahead, int64_t K, const float* x, const T* xt, int64_t B,
                       float* out) {
#ifdef __AVX512F__
  if constexpr (tiled<T>()) {
    if (nw == 4) {
      using Tile = void (*)(const T*, const T*, int, int64_t, const float*, const T*, float*);
      static constexpr Tile tiles[] = {tile<T, 1>, tile<T, 2>, tile<T, 3>, tile<T, 4>};
      const int64_t passes = (B + 3) / 4;        // over the rows of x, four at a time: the four rows at `ahead`
      for (int64_t b = 0, i = 0; b < B; b += 4, ++i) {             // asked for a share in each pass
        const int j0 = int(4 * i / passes), na = ahead ? int(4 * (i + 1) / passes) - j0 : 0;
        tiles[std::min(B - b, int64_t(4)) - 1](w, ahead ? ahead + j0 * K : nullptr, na, K, x + b * K, xt + b * K,
                                               out + b * 4);
      }
      return;
    }
  }
#endif
  if (ahead)
    for (int64_t byte = 0; byte < nw * K * int64_t(sizeof(T)); byte += 64)
      __builtin_prefetch((const char*)ahead + byte, 0, 2);
  float d[ROWS];
  for (int j = 0; j < nw; ++j) {
    row_dots(w + j * K, K, x, xt, B, d);
    for (int64_t b = 0; b < B; ++b) out[b * 4 + j] = d[b];
  }
}

// How many rows of K elements on the row to ask for lies: AHEAD bytes, at least four rows.
template <typename T>
inline int64_t rows_ahead(int64_t K) { return std::max(int64_t(4), AHEAD / (K * int64_t(sizeof(T)))); }

// Rows [lo, hi) of W [R, K] times x [B, K], four rows at a time: fn(b, r, dot) for each.
template <typename T, typename Fn>
inline void products(const T* W, int64_t lo, int64_t hi, int64_t K, const float* x, const T* xt, int64_t B, Fn fn) {
  float d[ROWS * 4];                                   // B <= ROWS
  const int64_t ahead = rows_ahead<T>(K);
  for (int64_t r = lo; r < hi; r += 4) {
    const int nw = int(std::min(hi - r, int64_t(4)));
    block_dots(W + r * K, nw, r + ahead + nw <= hi ? W + (r + ahead) * K : nullptr, K, x, xt, B, d);
    for (int j = 0; j < nw; ++j)
      for (int64_t b = 0; b < B; ++b) fn(b, r + j, d[b * 4 + j]);
  }
}

// This thread's share [lo, hi) of R rows.
inline std::pair<int64_t, int64_t> share(int64_t R, int id, int n) { return {R * id / n, R * (id + 1) / n}; }

template <typename T>
inline void widen(const T* x, int64_t n, float* out) { for (int64_t i = 0; i < n; ++i) out[i] = float(x[i]); }

template <typename T>      // h [n] (T's values, as floats) into ht [n], for the bfloat16 dot product
inline void narrow(const float* h, int64_t n, T* ht) {
  if (std::is_same_v<T, c10::BFloat16>) for (int64_t i = 0; i < n; ++i) ht[i] = T(h[i]);
}

// One decode step (step.py's docstring). x [B, D]: the tokens' embeddings in, the last layer's output out.
// layers [L, 9]: the addresses of each layer's input norm, q, k, v, o, post-attention norm, gate, up and down
// weights; cos, sin [B, Dh]; pools [L, pages, P, Hkv, Dh] (layer stride ls); slots [B]; tables [B, width];
// lengths [B] (the new token counted); logits [B, V].
template <typename T>
void step(T* x, const int64_t* layers, int64_t L, const T* final_norm, const T* head, const T* cos, const T* sin,
          T* k_pools, T* v_pools, int64_t ls, const int64_t* slots, const int* tables, int64_t width,
          const int* lengths, int64_t max_length, T* logits, int64_t B, int64_t D, int64_t Hq, int64_t Hkv,
          int64_t Dh, int64_t F, int64_t V, int64_t P, float eps, int64_t chunk, int64_t threads) {
  const int64_t Q = Hq * Dh, KV = Hkv * Dh, runs = (max_length + chunk - 1) / chunk, part = Hq * (Dh + 2);
  const float scale = 1.f / std::sqrt(float(Dh));
  std::vector<T> q(B * Q), k(B * KV), v(B * KV), att(B * Q), a(B * F);
  std::vector<float> qf(B * Q), parts(B * runs * part);
  const auto run = run_for<T>(Dh);
  #pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num(), n = omp_get_num_threads();
    std::vector<float> h(B * std::max({D, Q, F})), o(Dh);
    std::vector<T> ht(std::is_same_v<T, c10::BFloat16> ? h.size() : 0);   // h in T, for bfloat16 only
    auto norm = [&](const T* w) {                      // h = RMSNorm(x) * w, all of it, in every thread
      widen(x, B * D, h.data());
      for (int64_t b = 0; b < B; ++b) rms_row(h.data() + b * D, w, D, eps, h.data() + b * D);
      narrow(h.data(), B * D, ht.data());
    };
    const auto [q0, q1] = share(Q, id, n);
    const auto [k0, k1] = share(KV, id, n);
    const auto [d0, d1] = share(D, id, n);
    const auto [f0, f1] = share(F, id, n);
    for (int64_t l = 0; l < L; ++l) {
      const T* const* W = reinterpret_cast<const T* const*>(layers + l * 9);
      T *kp = k_pools + l * ls, *vp = v_pools + l * ls;
      norm(W[0]);
      products(W[1], q0, q1, D, h.data(), ht.data(), B, [&](int64_t b, int64_t r, float d) { q[b * Q + r] = T(d); });
      products(W[2], k0, k1, D, h.data(), ht.data(), B, [&](int64_t b, int64_t r, float d) { k[b * KV + r] = T(d); });
      products(W[3], k0, k1, D, h.data(), ht.data(), B, [&](int64_t b, int64_t r, float d) { v[b * KV + r] = T(d); });
      #pragma omp barrier
      #pragma omp for schedule(static)
      for (int64_t i = 0; i < B * (Hq + Hkv); ++i) {     // one head: turned; a key head and its value stored
        const int64_t b = i / (Hq + Hkv), j = i % (Hq + Hkv);
        if (j < Hq) {
          T* qh = q.data() + b * Q + j * Dh;
          rope_head(qh, cos + b * Dh, sin + b * Dh, Dh);
          for (int64_t d = 0; d < Dh; ++d) qf[b * Q + j * Dh + d] = float(qh[d]) * scale;
        } else {
          const int64_t at = b * KV + (j - Hq) * Dh, to = (slots[b] * Hkv + j - Hq) * Dh;
          rope_head(k.data() + at, cos + b * Dh, sin + b * Dh, Dh);
          std::memcpy(kp + to, k.data() + at, Dh * sizeof(T)), std::memcpy(vp + to, v.data() + at, Dh * sizeof(T));
        }
      }
      #pragma omp for schedule(static)
      for (int64_t task = 0; task < B * runs; ++task) {   // attention: a run of one sequence's positions
        const int64_t b = task / runs, length = lengths[b], start = std::min(task % runs * chunk, length);
        float* p = parts.data() + task * part;
        run(qf.data() + b * Q, kp, vp, tables + b * width, start, std::min(start + chunk, length), 0, 0, 1, Hq,
            Hkv, Dh, P, p, p + Hq, p + 2 * Hq);
      }
      #pragma omp for schedule(static)
      for (int64_t bh = 0; bh < B * Hq; ++bh)              // a query head's runs merged
        merge(Runs{parts.data() + bh / Hq * runs * part, runs, part, Hq}, bh % Hq, Runs{}, 0, Dh, o.data(),
              att.data() + bh * Dh);
      widen(att.data(), B * Q, h.data()), narrow(h.data(), B * Q, ht.data());
      products(W[4], d0, d1, Q, h.data(), ht.data(), B, [&](int64_t b, int64_t r, float d) {
        x[b * D + r] = T(float(x[b * D + r]) + float(T(d))); });
      #pragma omp barrier
      norm(W[5]);
      for (int64_t f = f0, ahead = rows_ahead<T>(D); f < f1; f += 4) {   // gate and up rows: a = SiLU(gate) * up
        const int nw = int(std::min(f1 - f, int64_t(4)));
        const bool pre = f + ahead + nw <= f1;
        float g[ROWS * 4], u[ROWS * 4];
        block_dots(W[6] + f * D, nw, pre ? W[6] + (f + ahead) * D : nullptr, D, h.data(), ht.data(), B, g);
        block_dots(W[7] + f * D, nw, pre ? W[7] + (f + ahead) * D : nullptr, D, h.data(), ht.data(), B, u);
        for (int j = 0; j < nw; ++j)
          for (int64_t b = 0; b < B; ++b) a[b * F + f + j] = silu_mul_one(T(g[b * 4 + j]), T(u[b * 4 + j]));
      }
      #pragma omp barrier
      widen(a.data(), B * F, h.data()), narrow(h.data(), B * F, ht.data());
      products(W[8], d0, d1, F, h.data(), ht.data(), B, [&](int64_t b, int64_t r, float d) {
        x[b * D + r] = T(float(x[b * D + r]) + float(T(d))); });
      #pragma omp barrier
    }
    norm(final_norm);
    const auto [v0, v1] = share(V, id, n);
    products(head, v0, v1, D, h.data(), ht.data(), B, [&](int64_t b, int64_t r, float d) { logits[b * V + r] = T(d); });
  }
}
"""
# endregion
