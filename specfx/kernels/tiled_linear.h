// specfx's few-row matmuls: y[M, N] = x[M, K] . w[N, K]^T (`linear`), for M up to a few dozen
// rows, and y[M, D] = p[M, L] . v[L, D] (`mix`: attention's weighted sum of values), each over
// a batch of such products.
//
// Weights are read in blocks of V rows (V = the vector's lanes). Each block is multiplied into
// every query row while it is in the L1/L2 cache, in tiles of RM query rows x RN weight rows
// (RM * RN = V accumulators, each a vector along K), so a weight row is read from memory once
// for all M rows. The V accumulators of a tile are summed across lanes together (a transposed
// reduction: log2(V) rounds of shuffles and adds give one vector of V outputs), not one
// horizontal sum per output. The next block's rows are prefetched while a block computes.
// Sizes: K and the batch are known when the caller is generated, and `mix`'s M; `linear`'s M
// (a prefill's width) and N (a span of cached keys) may vary per call.
#ifndef SPECFX_TILED_LINEAR_H
#define SPECFX_TILED_LINEAR_H
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace specfx_tiled {

#if defined(__AVX512F__)
constexpr int VB = 64;
#else
constexpr int VB = 32;
#endif
typedef float vf __attribute__((vector_size(VB), aligned(4)));
typedef int vi __attribute__((vector_size(VB)));
constexpr int V = VB / 4;

// The query rows `linear` hands to `block`: 3 left over after the tiles of 4 become one more
// tile of 4 (the third repeated), which reads each weight vector once for them where a tile of 2
// and one of 1 read it twice. (pycoder's 85 weight matrices at 3 rows, two threads, round-robin
// against 4 rows: 1.528 ms -> 1.444, where 4 rows took 1.421 and 1.429. Two rows left over stay
// a tile of 2, row by row: padded to 4 they ran 1.419 ms against 1.369.) Between 4 and 16 rows
// any rows left over are padded to a tile of 4, so that the block is read as one stream (see
// AHEAD): 5 rows 1.809-1.923 ms -> 1.191-1.251, 6 rows 2.020-2.176 -> 1.200-1.272, where 8 took
// 1.249-1.313 (the AVX-512 EPYC, round-robin in one process).
static inline long padded(long M) { return M % 4 == 3 || (M > 4 && M < 16 && M % 4) ? (M + 3) / 4 * 4 : M; }

static inline vf loadu(const float* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_loadu_ps(p);
#elif defined(__AVX__)
  return (vf)_mm256_loadu_ps(p);     // (a memcpy here goes through the stack under AVX2 tuning)
#else
  vf v;
  __builtin_memcpy(&v, p, VB);
  return v;
#endif
}

// A weight vector: float32 as it is, or bfloat16 (stored as uint16_t: a float's upper 16 bits)
// widened to float32 on load, so a bfloat16 weight streams half the bytes into the same FMAs.
static inline vf loadw(const float* p) { return loadu(p); }
static inline vf loadw(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
  vf v;
  for (int l = 0; l < V; l++) {
    unsigned bits = (unsigned)p[l] << 16;
    __builtin_memcpy((char*)&v + 4 * l, &bits, 4);
  }
  return v;
#endif
}
static inline float widen(float w) { return w; }
static inline float widen(uint16_t w) {
  unsigned bits = (unsigned)w << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

static inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

#if defined(__clang__) || __GNUC__ >= 12
#define SPECFX_SHUFFLE(u, v, ...) __builtin_shufflevector(u, v, __VA_ARGS__)
#else
#define SPECFX_SHUFFLE(u, v, ...) __builtin_shuffle(u, v, vi{__VA_ARGS__})
#endif

// In each group of 2H lanes, the first H take u's group folded in half, the last H v's.
template <int H, class T> static inline T fold(T u, T v) {
#if defined(__AVX512F__)
  if constexpr (H == 8)
    return SPECFX_SHUFFLE(u, v, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SPECFX_SHUFFLE(u, v, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  else if constexpr (H == 4)
    return SPECFX_SHUFFLE(u, v, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SPECFX_SHUFFLE(u, v, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  else if constexpr (H == 2)
    return SPECFX_SHUFFLE(u, v, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SPECFX_SHUFFLE(u, v, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  else
    return SPECFX_SHUFFLE(u, v, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           SPECFX_SHUFFLE(u, v, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#else
  if constexpr (H == 4)
    return SPECFX_SHUFFLE(u, v, 0, 1, 2, 3, 8, 9, 10, 11) + SPECFX_SHUFFLE(u, v, 4, 5, 6, 7, 12, 13, 14, 15);
  else if constexpr (H == 2)
    return SPECFX_SHUFFLE(u, v, 0, 1, 8, 9, 4, 5, 12, 13) + SPECFX_SHUFFLE(u, v, 2, 3, 10, 11, 6, 7, 14, 15);
  else
    return SPECFX_SHUFFLE(u, v, 0, 8, 2, 10, 4, 12, 6, 14) + SPECFX_SHUFFLE(u, v, 1, 9, 3, 11, 5, 13, 7, 15);
#endif
}

// Pins a vector value to a register (an empty asm that reads and writes it there).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPECFX_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define SPECFX_IN_REGISTER(v) ((void)0)
#endif

// V accumulators -> one vector whose lane p holds the sum of accumulator bitrev(p) (float32
// accumulators, or int32 ones: `vi`).
template <int H, int I, int S, class T> static inline T reduce(const T* a) {
  if constexpr (H == 0) return a[I];
  else return fold<H>(reduce<H / 2, I, 2 * S>(a), reduce<H / 2, I + S, 2 * S>(a));
}
constexpr int bitrev(int p) {
  int r = 0;
  for (int b = 1; b < V; b <<= 1) { r = (r << 1) | (p & 1); p >>= 1; }
  return r;
}

// Output lane I = i * RN + j accumulates x[i] * w[j] in accumulator bitrev(I), so the
// reduction leaves the outputs in order. Unrolled at compile time: the accumulators stay in
// registers only if every index is a constant when the compiler first sees it.
template <int I, int RN> struct Fma {
  static inline __attribute__((always_inline)) void run(vf* acc, const vf* xv, const vf* wv) {
    acc[bitrev(I)] = fmadd(xv[I / RN], wv[I % RN], acc[bitrev(I)]);
    if constexpr (I + 1 < V) Fma<I + 1, RN>::run(acc, xv, wv);
  }
};

template <int RM, int RN, typename TW>
static inline __attribute__((always_inline)) void step(vf* acc, const float* x, std::size_t sx,
                                                       const TW* w, std::size_t sw) {
  vf xv[RM], wv[RN];
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++) xv[i] = loadu(x + i * sx);
#pragma GCC unroll 16
  for (int j = 0; j < RN; j++) wv[j] = loadw(w + j * sw);
  // Held in registers: left to itself, GCC folds each weight load into every FMA that uses it,
  // loading a weight vector RM times (20 loads for 16 FMAs at RM = 4: load-bound).
#pragma GCC unroll 16
  for (int j = 0; j < RN; j++) SPECFX_IN_REGISTER(wv[j]);
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++) SPECFX_IN_REGISTER(xv[i]);
  Fma<0, RN>::run(acc, xv, wv);
}

// One weight row j of a tile read front to back into RM accumulators (x[i] . w[j] for i < RM),
// stored where the tile's reduction expects them (accumulator bitrev(i * RN + j)). Under four
// query rows each row's sum is split over CHAINS / RM accumulators along K (consecutive vectors
// in turn, added together at the end), so that CHAINS multiply-adds are in flight: with one
// chain a row every vector waits out the FMA's latency (4 cycles), which caps one query row at
// 2 floats a cycle, below what the cache delivers and near what memory does. Four rows are four
// chains already. (A C++ harness, two threads, a 2-core AMD EPYC, the kernels round-robin: an
// int8 MTP head's 9 linears at one row, in cache, 164-168 us -> 102-117; pycoder's 85 float32
// matrices at one row, from memory, 2.24 ms -> 2.06; one layer's at two rows 9% faster.)
constexpr int CHAINS = 8;
template <int RM, int C, typename TW>
static inline __attribute__((always_inline)) void chains(vf* a, const float* x, const TW* wj, int K, int& k,
                                                         const TW* pf) {
  vf b[RM][C];
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++)
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) b[i][c] = vf{};
  for (; k + C * V <= K; k += C * V)
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) {
      const int kc = k + c * V;
      if (pf) __builtin_prefetch(pf + kc, 0, 2);
      vf wv = loadw(wj + kc);
      SPECFX_IN_REGISTER(wv);
#pragma GCC unroll 16
      for (int i = 0; i < RM; i++) b[i][c] = fmadd(loadu(x + (std::size_t)i * K + kc), wv, b[i][c]);
    }
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++)
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) a[i] += b[i][c];
}

template <int RM, int RN, typename TW>
static inline __attribute__((always_inline)) void row(vf* acc, const float* x, const TW* w, int j, int K,
                                                      const TW* pf) {
  vf a[RM];
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++) a[i] = vf{};
  const TW* wj = w + (std::size_t)j * K;
  int k = 0;
  if constexpr (RM < 4) chains<RM, CHAINS / RM>(a, x, wj, K, k, pf);
  for (; k + V <= K; k += V) {
    if (pf) __builtin_prefetch(pf + k, 0, 2);
    vf wv = loadw(wj + k);
    SPECFX_IN_REGISTER(wv);
#pragma GCC unroll 16
    for (int i = 0; i < RM; i++) a[i] = fmadd(loadu(x + (std::size_t)i * K + k), wv, a[i]);
  }
  if (k < K) {                                  // the last partial vector, zero-padded
    float wt[V] = {}, xt[V] = {};
    for (int l = k; l < K; l++) wt[l - k] = widen(wj[l]);
    const vf wv = loadu(wt);
    for (int i = 0; i < RM; i++) {
      for (int l = k; l < K; l++) xt[l - k] = x[(std::size_t)i * K + l];
      a[i] = fmadd(loadu(xt), wv, a[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++) acc[bitrev(i * RN + j)] = a[i];
}

// y[i, j] = x[i, :] . w[j, :] for i < RM, j < RN; y's rows are N apart. `pf`, when set, is
// the first of `pf_rows` (at most RN) rows, K apart, that this thread reads next, prefetched
// alongside w; or, for a tile of four rows read side by side given `ahead_end`, the weights
// AHEAD bytes past where the tile reads, up to `ahead_end` (see AHEAD). Tiles of one or two
// query rows read their weight rows one after another, each front to back (a plain stream,
// which the hardware prefetches too); tiles of four read their weight rows side by side, as
// one pass of V products per step (but see FOUR_BY_ROW_BELOW).
// (pycoder's 85 weight matrices, two threads, in a C++ harness, on an Intel Xeon with AVX-512,
// against side by side for every tile: row by row,
// 1 row ran 13-22% faster and 2 rows 6-14% faster, while tiles of four read row by row made
// 4 rows 0-5% and 8 rows 20-40% slower.)
//
// Query rows in whole tiles of four, padded where needed (M = 3 to 16, see `padded`: a verify
// of k + 1 positions, a tree's N + 1) read the weights as one stream (see `block`): each tile
// of four prefetches the weights AHEAD bytes past the ones it reads, into L1, up to the end of
// the weight; the rows of a block and the blocks of a thread follow each other in memory.
// Prefetched block by block instead (the next block's rows, spread over the passes of query
// rows), or nearer, 4 rows ran slower than one. (pycoder's 85 weight matrices, two threads, a
// 2-core AMD EPYC with AVX-512, kernels round-robin in one process: 4 rows 1.218-1.251 ms ->
// 1.062-1.097 with 16 KB ahead, against 1.025-1.047 for one row; 8 KB 1.117-1.173, 24 KB
// 1.151-1.184, into L2 1.115-1.156. 8 rows, passes of four block by block -> each weight group
// through both tiles in turn: 1.522-1.633 ms -> 1.322-1.495; 16 rows 2.026-2.247 ->
// 1.888-2.072.)
constexpr int AHEAD = 16384;

// Which cache those prefetches fill: 3 (L1, `prefetcht0`) or 2 (L2, `prefetcht1`). The graph's
// source defines it from the machine (`tiled_linear.ahead_locality`): where a core's L1 holds
// 48 KB or more, L1; where it holds less, L2. (pycoder's 85 matrices as 49 kernels, two threads, both
// levels compiled in one process and timed round-robin, `benchmarks/prefetch.py`: on a 2-core
// AMD EPYC with AVX-512 and a 32 KB L1, 4 rows 3.16-3.69 ms into L1 against 2.71-2.96 into L2,
// 8 rows 3.76-4.54 against 2.75-2.98, one row 2.49-2.77 either way, and the 2x2x1x1x1 tree's
// fused MTP step 5.41-6.68 against 4.47-4.94; on the AVX-512 EPYC above, a Zen 5 whose L1
// holds 48 KB, 4 rows 1.062-1.097 ms into L1 against 1.115-1.156 into L2.)
#ifndef SPECFX_AHEAD_LOCALITY
#define SPECFX_AHEAD_LOCALITY 3
#endif

// Each tile is a function of its own: the query rows are known only at run time in `block`, so
// inlined there every tile's loops would share one function's registers, and the ones the
// tiles of one and two rows take (see `row`) push the tile of four's row pointers to the stack
// (an int8 head's 9 linears at 4 rows, in cache: 30% slower).
template <int RM, int RN, typename TW, bool BY_ROW = (RM <= 2)>
static __attribute__((noinline)) void tile(const float* __restrict x, const TW* __restrict w, float* __restrict y,
                        int K, int N, const TW* pf, int pf_rows, int rows = RM, const TW* ahead_end = nullptr) {
  static_assert(RM * RN == V, "one accumulator per output lane");
  vf acc[V];
  if constexpr (BY_ROW) {
#pragma GCC unroll 16
    for (int j = 0; j < RN; j++) row<RM, RN>(acc, x, w, j, K, pf && j < pf_rows ? pf + (std::size_t)j * K : (const TW*)nullptr);
  } else {
#pragma GCC unroll 16
    for (int a = 0; a < V; a++) acc[a] = vf{};
    int k = 0;
    if (ahead_end)                                // the tile's rows are K apart: RN * k is how far it has read
      for (; k + V <= K; k += V) {
        const char* ahead = (const char*)(w + (std::size_t)RN * k) + AHEAD;
#pragma GCC unroll 16
        for (int q = 0; q < RN * (int)sizeof(TW) * V / 64; q++)       // the lines this step reads
          if (ahead + 64 * q < (const char*)ahead_end) __builtin_prefetch(ahead + 64 * q, 0, SPECFX_AHEAD_LOCALITY);
        step<RM, RN>(acc, x + k, K, w + k, K);
      }
    else if (pf)
      for (; k + V <= K; k += V) {
#pragma GCC unroll 16
        for (int j = 0; j < RN; j++)
          if (j < pf_rows) __builtin_prefetch(pf + (std::size_t)j * K + k, 0, 2);
        step<RM, RN>(acc, x + k, K, w + k, K);
      }
    for (; k + V <= K; k += V) step<RM, RN>(acc, x + k, K, w + k, K);
    if (k < K) {                                  // the last partial vectors, zero-padded
      float xt[RM][V] = {}, wt[RN][V] = {};
      for (int i = 0; i < RM; i++)
        for (int l = k; l < K; l++) xt[i][l - k] = x[(std::size_t)i * K + l];
      for (int j = 0; j < RN; j++)
        for (int l = k; l < K; l++) wt[j][l - k] = widen(w[(std::size_t)j * K + l]);
      step<RM, RN>(acc, xt[0], V, wt[0], V);
    }
  }
  vf r = reduce<V / 2, 0, 1>(acc);
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++)
    if (i < rows)                                 // the first `rows` of y (a padded tile's)
#pragma GCC unroll 16
      for (int j = 0; j < RN; j++) y[(std::size_t)i * N + j] = r[i * RN + j];
}

// Four query rows that make the only pass over a block (M = 3 or 4: a verify of k + 1 = 4
// positions) read their weight rows side by side, except under AVX2 over rows shorter than
// FOUR_BY_ROW_BELOW floats, which they read one after another. (Two threads, kernels
// round-robin in one process, weights streamed from memory, four rows against one. A 2-core AMD
// EPYC, AVX2, a C++ harness: rows of 320 floats 1.17-1.23x one row's time row by row,
// 1.26-1.29x side by side; of 512, 1.29x and 1.15x; of 864, 1.22x and 1.08x; of 1024 to 5632,
// 1.09-1.27x and 0.94-1.03x. pycoder's 85 matrices (rows of 320 and 864) 1.27, 1.44 and 1.31x
// all row by row, 1.24, 1.38 and 1.21x with its 864-float rows side by side; a Qwen2-0.5B-shaped
// layer pair 1.17x and 1.00-1.02x. 8 rows, two passes, stay side by side, 1.15x one row's. On
// an Intel Xeon, AVX-512, row by row made 4 rows of pycoder 0-5% slower. Inside a compiled step
// the gain is smaller than the harness's: the 4-row verify of a 4-layer Llama 1024 wide, on this
// kernel, 9.175 -> 9.115 ms against its decode step's 6.750, round-robin in one process.)
#if defined(__AVX512F__)
constexpr int FOUR_BY_ROW_BELOW = 0;
#else
constexpr int FOUR_BY_ROW_BELOW = 512;
#endif

// V weight rows from row n, times every query row: tiles of 4 query rows, then 2, then 1;
// x holds padded(M) rows (see `linear`), so that 3 rows left over run as one tile of 4 whose
// last row repeats row M - 1 and is not stored. (M is a constant where the caller's is, once
// inlined.) With `prefetch`, the next block's rows are prefetched spread over all the passes
// (one per tile of query rows), so that they stream in while the later passes compute from the
// cache: pass p of P prefetches the next block's rows [V p / P, V (p + 1) / P), split among its
// tiles. (Over pycoder's 85 weight matrices, two threads: 8 and 16 rows 8-14% faster than with
// all of them issued in the first pass.) Where the query rows are whole tiles of four, the
// block is read as one stream instead: each group of four weight rows goes through every tile
// of query rows in turn (the later ones find it in L1), every tile prefetching ahead up to
// `end`, where w's rows end (see AHEAD). Up to 16 rows (a verify's); a prefill's chunk keeps
// the passes, whose four query rows stay in L1 while a block goes through them.
template <typename TW>
static inline void block(long M, const float* x, const TW* w, float* y, int K, int N, int n, bool prefetch,
                         const TW* end) {
  const TW* wn = w + (std::size_t)n * K;
  const TW* next = wn + (std::size_t)V * K;
  const long Mp = padded(M);
  const long passes = Mp / 4 + Mp % 4 / 2 + Mp % 2;
  long m = 0, pass = 0;
  // Tile `t` of `tiles` in this pass prefetches the next block's rows [first(t), first(t + 1)).
  auto first = [&](int t, int tiles) {
    const long lo = V * pass / passes, hi = V * (pass + 1) / passes;
    return lo + (hi - lo) * t / tiles;
  };
  auto pf = [&](int t, int tiles) { return prefetch ? next + (std::size_t)first(t, tiles) * K : (const TW*)nullptr; };
  auto pf_rows = [&](int t, int tiles) { return (int)(first(t + 1, tiles) - first(t, tiles)); };
  if (Mp == 4 && K < FOUR_BY_ROW_BELOW) {
    for (int t = 0, j = 0; j < V; t++, j += V / 4)
      tile<4, V / 4, TW, true>(x, wn + (std::size_t)j * K, y + n + j, K, N, pf(t, 4), pf_rows(t, 4), (int)M);
    return;
  }
  if (Mp % 4 == 0 && Mp <= 16) {                 // read as one stream (see AHEAD)
    for (int j = 0; j < V; j += V / 4)
      for (long m4 = 0; m4 < Mp; m4 += 4)
        tile<4, V / 4>(x + (std::size_t)m4 * K, wn + (std::size_t)j * K, y + (std::size_t)m4 * N + n + j, K, N,
                       (const TW*)nullptr, 0, (int)std::min<long>(4, M - m4), end);
    return;
  }
  for (; m + 4 <= Mp; m += 4, pass++)
    for (int t = 0, j = 0; j < V; t++, j += V / 4)
      tile<4, V / 4>(x + (std::size_t)m * K, wn + (std::size_t)j * K, y + (std::size_t)m * N + n + j, K, N,
                     pf(t, 4), pf_rows(t, 4), (int)std::min<long>(4, M - m));
  for (; m + 2 <= M; m += 2, pass++)
    for (int t = 0, j = 0; j < V; t++, j += V / 2)
      tile<2, V / 2>(x + (std::size_t)m * K, wn + (std::size_t)j * K, y + (std::size_t)m * N + n + j, K, N,
                     pf(t, 2), pf_rows(t, 2));
  for (; m < M; m++, pass++) tile<1, V>(x + (std::size_t)m * K, wn, y + (std::size_t)m * N + n, K, N, pf(0, 1), pf_rows(0, 1));
}

// Int8 weights (a draft's at a quarter of the bytes, each row scaled after the product: see
// `mtp.StoredLinear`) take int8 rows too. Each query row is quantized as the
// weights' rows are: q = x / s rounded to the nearest integer (ties to even), s its largest
// magnitude over 127 (1 for a row of zeros); a weight row's products with q are summed as
// integers, exactly, and y = float(sum) * s. AVX2 multiplies 32 int8 pairs an instruction
// (`vpmaddubsw`: |q| as unsigned times the weight with q's sign, pairs added into 16 bits, which
// cannot overflow at magnitudes of at most 127; `vpmaddwd` adds those into 32-bit lanes), where
// widened to float32 a weight costs a conversion and an FMA every 8. (The MTP head of pycoder,
// its 9 linears at one row, in cache, a C++ harness on a 2-core AMD EPYC: 112 us widened, 64
// us quantized.) The quantized row changes the draft's logits by about its rounding (under 1%
// of their scale); only drafts read int8 weights, and verification keeps the output exact.
// `tiled_linear.quantized_reference` is the same computation in torch, equal to the last bit.
struct QuantizedRows {
  std::vector<int8_t> q, a;     // each row's integers and their magnitudes, K apart
  std::vector<float> s;         // each row's scale
};

static inline void quantize_rows(const float* x, long rows, int K, QuantizedRows& out) {
  out.q.resize((std::size_t)rows * K);
  out.a.resize((std::size_t)rows * K);
  out.s.resize(rows);
  for (long r = 0; r < rows; r++) {
    const float* xr = x + (std::size_t)r * K;
    int8_t* q = out.q.data() + (std::size_t)r * K;
    int8_t* a = out.a.data() + (std::size_t)r * K;
    float top = 0;
    int k = 0;
#if defined(__AVX2__)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vtop = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) vtop = _mm256_max_ps(vtop, _mm256_and_ps(_mm256_loadu_ps(xr + k), magnitude));
    float lanes[8];
    _mm256_storeu_ps(lanes, vtop);
    for (int l = 0; l < 8; l++) top = std::max(top, lanes[l]);
#endif
    for (; k < K; k++) top = std::max(top, std::fabs(xr[k]));
    const float s = top > 0 ? top / 127.f : 1.f, inv = 1.f / s;
    k = 0;
#if defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    for (; k + 8 <= K; k += 8) {                  // rounded half to even, as nearbyint in the default mode
      const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), vinv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
      const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
      const __m128i i8 = _mm_packs_epi16(i16, i16);
      _mm_storel_epi64((__m128i*)(q + k), i8);
      _mm_storel_epi64((__m128i*)(a + k), _mm_abs_epi8(i8));
    }
#endif
    for (; k < K; k++) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xr[k] * inv)));
      q[k] = (int8_t)v;
      a[k] = (int8_t)std::fabs(v);
    }
    out.s[r] = s;
  }
}

// The integer sum of w[k] q[k] over k < K (a = |q|).
static inline int32_t dot_i8(const int8_t* w, const int8_t* q, const int8_t* a, int K) {
  int k = 0;
  int32_t sum = 0;
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  for (; k + 32 <= K; k += 32) {
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + k));
    const __m256i signed_w = _mm256_sign_epi8(wv, _mm256_loadu_si256((const __m256i*)(q + k)));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)(a + k)), signed_w);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  sum = _mm_cvtsi128_si32(h);
#endif
  for (; k < K; k++) sum += (int32_t)w[k] * q[k];
  return sum;
}

// y [M, N_0 + ... + N_{G-1}] = x [M, K] . [w_0; ...; w_{G-1}]^T for int8 w_g, x quantized once
// (above), w_g's products in its own columns (see the float32 `linears` below; G = 1: one
// linear). Threads split the weight rows, each thread's a contiguous range read once from memory
// for all M rows. With AVX-512 the rows go V at a time through `dot_i8_tile`, the rest one at a
// time through `dot_i8`. (The int8 MTP head of pycoder, its 6 kernels 20 times over in one
// graph, in cache, two threads, a 2-core AMD EPYC with AVX-512, against `dot_i8` for every row:
// one query row 34.1-35.3 -> 27.6-29.7 us a pass, four rows 100.4-102.2 -> 66.3-69.1, the
// outputs equal to the bit. Then the accumulators in registers and, with AVX512-VNNI, over more
// than two rows q + 128 against the weight as it lies in memory (`dot_u8_tile`): the head's fc,
// q/k/v, o, gate/up and down as 5 kernels in one graph, in cache, the two headers' graphs
// round-robin in one process: 1 row 20.5-20.6 -> 19.5-19.7 us, 2 rows 27.4-27.7 -> 25.9-26.1,
// 4 rows 41.5-42.4 -> 36.0-36.1, 6 rows (a tree's refill) 56.0-57.9 -> 45.3-45.5. Then a task's V
// rows taken from one weight, K bytes apart from one pointer, with the kernel inlined into its
// call, where K is a literal, and the V sums scaled as one vector: the head's 6 kernels with its
// lm_head, `benchmarks/kernels/int8_head.cpp` against the previous header, the same bits, two
// threads: 1 row 51.73 -> 42.83 us, 4 rows 138.25 -> 109.92, 6 rows 185.95 -> 146.85; one
// thread, 1 row 70.88 -> 59.59. Where a weight's rows are not a whole number of tiles, its last
// ones go one at a time.)
#if defined(__AVX512BW__)
// The integer sums w_j . q over K for V columns j at once (w_j: V rows of one weight, K bytes
// apart from w; q one quantized query row, a = |q|), each column's in an accumulator of its own,
// then reduced across lanes together (`reduce`): lane j of the result holds column j's sum. A
// step of 64 products a column is one masked negation (w where q >= 0, -w where q < 0: the sign mask is q's, shared by
// the V columns) and the products of |q| (unsigned) with it: `vpmaddubsw` (pairs into 16 bits,
// which cannot overflow at magnitudes of at most 127), `vpmaddwd` (into 32-bit lanes) and an add;
// with AVX512-VNNI one `vpdpbusd` (four products into each 32-bit lane, added to it, never
// saturating). The sums are exact integers, so they equal `dot_i8`'s to the bit. Column j sums
// into accumulator j (a constant index once the loop is unrolled, so the accumulators stay in
// registers; indexed by bitrev(j) there, GCC kept some of them on the stack) and goes to
// position bitrev(j) for the reduction.
static inline __m512i madd_i8(__m512i acc, __m512i a, __m512i signed_w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, a, signed_w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, signed_w), _mm512_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) vi dot_i8_tile(const int8_t* w, const int8_t* q, const int8_t* a,
                                                           int K) {
  __m512i acc[V];
#pragma GCC unroll 16
  for (int j = 0; j < V; j++) acc[j] = _mm512_setzero_si512();
  const __m512i zero = _mm512_setzero_si512();
  int k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i av = _mm512_loadu_si512(a + k);
    const __mmask64 neg = _mm512_movepi8_mask(_mm512_loadu_si512(q + k));
#pragma GCC unroll 16
    for (int j = 0; j < V; j++) {
      const __m512i wv = _mm512_loadu_si512(w + (std::size_t)j * K + k);
      acc[j] = madd_i8(acc[j], av, _mm512_mask_sub_epi8(wv, neg, zero, wv));
    }
  }
  if (k < K) {                                      // the last bytes, the rest of the vector zero
    const __mmask64 live = ~0ULL >> (64 - (K - k));
    const __m512i av = _mm512_maskz_loadu_epi8(live, a + k);
    const __mmask64 neg = _mm512_movepi8_mask(_mm512_maskz_loadu_epi8(live, q + k));
#pragma GCC unroll 16
    for (int j = 0; j < V; j++) {
      const __m512i wv = _mm512_maskz_loadu_epi8(live, w + (std::size_t)j * K + k);
      acc[j] = madd_i8(acc[j], av, _mm512_mask_sub_epi8(wv, neg, zero, wv));
    }
  }
  vi sums[V];
#pragma GCC unroll 16
  for (int j = 0; j < V; j++) sums[bitrev(j)] = (vi)acc[j];
  return reduce<V / 2, 0, 1>(sums);
}
#endif

#if defined(__AVX512VNNI__)
// The sums of b[k] w_j[k] over K for V columns j at once, b unsigned (64 bytes a step from
// `b(k, live)`, the live bytes of the step), one `vpdpbusd` a column and step, reading w_j
// straight from memory: no sign to apply, so no copy of the weight. Over several query rows
// (see `linears`) b is q + 128 and the sum less 128 times the column's sum (b = 128 once per
// tile) is the sum over q, exactly: |sum| <= 255 * 127 * K fits 32 bits.
template <typename B>
static inline __attribute__((always_inline)) vi dot_u8_tile(const int8_t* w, int K, B b) {
  __m512i acc[V];
#pragma GCC unroll 16
  for (int j = 0; j < V; j++) acc[j] = _mm512_setzero_si512();
  int k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i bv = b(k, ~0ULL);
#pragma GCC unroll 16
    for (int j = 0; j < V; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], bv, _mm512_loadu_si512(w + (std::size_t)j * K + k));
  }
  if (k < K) {                                      // the last bytes: the weight's past K read as zeros
    const __mmask64 live = ~0ULL >> (64 - (K - k));
    const __m512i bv = b(k, live);
#pragma GCC unroll 16
    for (int j = 0; j < V; j++)
      acc[j] = _mm512_dpbusd_epi32(acc[j], bv, _mm512_maskz_loadu_epi8(live, w + (std::size_t)j * K + k));
  }
  vi sums[V];
#pragma GCC unroll 16
  for (int j = 0; j < V; j++) sums[bitrev(j)] = (vi)acc[j];
  return reduce<V / 2, 0, 1>(sums);
}
#endif

// y[j] = float(sums[j]) * s for the V lanes (as the scalar conversion and product round them).
static inline void store_scaled(float* y, vi sums, float s) {
  const vf f = __builtin_convertvector(sums, vf) * s;
  __builtin_memcpy(y, &f, sizeof f);
}

template <int G>
static inline __attribute__((always_inline)) void linears(long M, const float* x, const int8_t* const* w,
                                                          const long* n, float* y, int K, int threads) {
  static thread_local QuantizedRows rows;          // kept: a step calls this for every linear
  quantize_rows(x, M, K, rows);
  const int8_t* q = rows.q.data();
  const int8_t* a = rows.a.data();
  const float* s = rows.s.data();
  long col[G + 1] = {0}, first[G + 1] = {0};       // each weight's first column, and its first tile
  for (int g = 0; g < G; g++) col[g + 1] = col[g] + n[g];
  const long N = col[G];
#if defined(__AVX512BW__)
  for (int g = 0; g < G; g++) first[g + 1] = first[g] + n[g] / V;
  // V rows of one weight a task, K bytes apart, each query row's V sums reduced together.
  const long tiles = first[G];
#pragma omp parallel for num_threads(threads) schedule(static) if (tiles >= 2 * threads)
  for (long t = 0; t < tiles; t++) {
    int g = 0;
    while (t >= first[g + 1]) g++;
    const int8_t* wt = w[g] + (std::size_t)(t - first[g]) * V * K;
    float* yt = y + col[g] + (t - first[g]) * V;
#if defined(__AVX512VNNI__)
    if (M > 2) {                                    // q + 128 against w, less 128 times w's sums
      const __m512i flip = _mm512_set1_epi8((char)0x80);
      const vi shift = dot_u8_tile(wt, K, [&](int, __mmask64 live) { return _mm512_maskz_mov_epi8(live, flip); });
      for (long m = 0; m < M; m++) {
        const int8_t* qm = q + (std::size_t)m * K;
        const vi sums = dot_u8_tile(wt, K, [&](int k, __mmask64 live) {
          return _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, qm + k), flip); }) - shift;
        store_scaled(yt + (std::size_t)m * N, sums, s[m]);
      }
      continue;
    }
#endif
    for (long m = 0; m < M; m++) {
      const vi sums = dot_i8_tile(wt, q + (std::size_t)m * K, a + (std::size_t)m * K, K);
      store_scaled(yt + (std::size_t)m * N, sums, s[m]);
    }
  }
#endif
  // The rows past each weight's last whole tile (every row without AVX-512), one at a time.
  auto tiled = [&](int g) { return (first[g + 1] - first[g]) * V; };   // weight g's rows in tiles
  const long left = N - first[G] * V;
#pragma omp parallel for num_threads(threads) schedule(static) if (left >= 2 * threads * V)
  for (long i = 0; i < left; i++) {
    int g = 0;
    long r = i;                                     // the i-th such row: weight g's row r
    for (; r >= n[g] - tiled(g); g++) r -= n[g] - tiled(g);
    r += tiled(g);
    const int8_t* wc = w[g] + (std::size_t)r * K;
    for (long m = 0; m < M; m++)
      y[(std::size_t)m * N + col[g] + r] = (float)dot_i8(wc, q + (std::size_t)m * K, a + (std::size_t)m * K, K) * s[m];
  }
}

static inline __attribute__((always_inline)) void linear_q8(long M, const float* x, const int8_t* w, float* y, long N,
                                                            int K, int threads) {
  linears<1>(M, x, &w, &N, y, K, threads);
}

// `linear` (below) over int8 weights, batch by batch through `linear_q8`.
static inline __attribute__((always_inline)) void linear(long M, const float* x, const int8_t* w, float* y,
                                                         int batches, long N, int K, long wb, int threads) {
  for (int b = 0; b < batches; b++)
    linear_q8(M, x + (std::size_t)b * M * K, w + b * wb, y + (std::size_t)b * M * N, N, K, threads);
}

// y[m, r] = x[m] . w[r] for the rows r in [from, N) past the last whole block, one at a time; y's
// rows ld apart.
template <typename TW>
static inline void tail(long M, const float* x, const TW* w, float* y, long from, long N, long ld, int K) {
  for (long r = from; r < N; r++)
    for (long m = 0; m < M; m++) {
      const float* xr = x + (std::size_t)m * K;
      const TW* wr = w + (std::size_t)r * K;
      float s = 0;
      for (int k = 0; k < K; k++) s += xr[k] * widen(wr[k]);
      y[(std::size_t)m * ld + r] = s;
    }
}

// x's rows as `block` reads them: x itself, or where padded(M) > M a copy with each batch's last
// row repeated (kept: a step calls this for every linear).
static inline const float* padded_rows(const float* x, long M, int K, int batches) {
  const long Mp = padded(M);
  if (Mp == M) return x;
  static thread_local std::vector<float> copy;
  if (copy.size() < (std::size_t)batches * Mp * K) copy.resize((std::size_t)batches * Mp * K);
  for (int b = 0; b < batches; b++) {
    float* dst = copy.data() + (std::size_t)b * Mp * K;
    std::memcpy(dst, x + (std::size_t)b * M * K, sizeof(float) * M * K);
    for (long m = M; m < Mp; m++)
      std::memcpy(dst + (std::size_t)m * K, x + ((std::size_t)b * M + M - 1) * K, sizeof(float) * K);
  }
  return copy.data();
}

// Batch b: y[b] = x[b] @ w[b].T, x [M, K] and y [M, N] contiguous, w's rows K apart and its
// batches wb apart (a slice of a KV cache: wb is the cache's length times K). Threads split the
// (batch, block) pairs. M is a constant in a step's graph, a prefill's width in a prefill's.
template <typename TW>
static void linear(long M, const float* x, const TW* w, float* y, int batches, long N, int K, long wb,
                   int threads) {
  const long blocks = N / V, tasks = batches * blocks, Mp = padded(M);
  const float* xp = padded_rows(x, M, K, batches);
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks >= 2 * threads)
  for (long t = 0; t < tasks; t++) {
    const long b = t / blocks, n = (t % blocks) * V;
    block(M, xp + b * Mp * K, w + b * wb, y + b * M * N, K, (int)N, (int)n, n + 2 * V <= N, w + b * wb + N * K);
  }
  for (int b = 0; b < batches; b++)
    tail(M, x + (std::size_t)b * M * K, w + b * wb, y + (std::size_t)b * M * N, blocks * V, N, N, K);
}

// A few query rows, G weights of K-long rows read as one: y [M, N_0 + ... + N_{G-1}] = x [M, K] .
// [w_0; ...; w_{G-1}]^T, w_g's products in its own columns. A layer's linears of one input (its q,
// k and v projections, its MLP's gate and up) then run in one parallel region, where one kernel
// each paid a fork and a join and a ramp of the weight stream each: pycoder's 85 float32 matrices
// as 49 kernels, two threads, a 2-core AMD EPYC with AVX-512 (benchmarks/grouped_linears.py):
// 1 row 1.20-1.22 ms -> 1.16-1.18, 4 rows 1.40-1.42 -> 1.35-1.39, 8 rows 1.47-1.51 -> 1.36-1.38.
// Each output is what `linear` computes, to the bit: the same blocks and tiles, over a task list
// that runs through every weight's blocks.
template <int G, typename TW>
static void linears(long M, const float* x, const TW* const* w, const long* n, float* y, int K, int threads) {
  long first[G + 1] = {0}, col[G + 1] = {0};       // each weight's first block, its first column
  for (int g = 0; g < G; g++) first[g + 1] = first[g] + n[g] / V, col[g + 1] = col[g] + n[g];
  const long N = col[G];
  const float* xp = padded_rows(x, M, K, 1);
#pragma omp parallel for num_threads(threads) schedule(static) if (first[G] >= 2 * threads)
  for (long t = 0; t < first[G]; t++) {
    int g = 0;
    while (t >= first[g + 1]) g++;
    const long r = (t - first[g]) * V;
    block(M, xp, w[g], y + col[g], K, (int)N, (int)r, r + 2 * V <= n[g], w[g] + n[g] * K);
  }
  for (int g = 0; g < G; g++) tail(M, x, w[g], y + col[g], n[g] / V * V, n[g], N, K);
}

// exp(x) lane by lane, to a few ulp: 2^n e^r, n = x log2(e) rounded, r = x - n ln(2) in two
// parts, e^r by Cephes' expf polynomial; x clamped so that 2^n stays a normal float.
static inline vf exp_lanes(vf x) {
  const vf zero = {}, lo = zero - 87.3f, hi = zero + 88.3f;
  x = x < lo ? lo : x > hi ? hi : x;
  const vf t = x * 1.44269504088896341f;
  const vi n = __builtin_convertvector(t + (t >= 0 ? zero + 0.5f : zero - 0.5f), vi);     // rounded half away from 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (n + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A gated MLP's first half, y [M, N] = silu(x . wg^T) * (x . wu^T) (silu(a) = a / (1 + e^-a)),
// x [M, K], wg and wu [N, K]: a task is one block of V columns, both weights' products (`block`,
// as `linear` computes them, into the thread's own scratch) and their gated product, so that each
// thread multiplies what it computed. Apart, the tiled kernel wrote the gate's columns from one
// thread and the up projection's from the other, and Inductor's one-thread pointwise kernel read
// half of them from the other core's cache: at 8 rows 2 x 27 KB a layer, where pycoder's 8-row
// verify spent about 17 us a layer in that kernel, stalled on those loads (perf, a 2-core AMD
// EPYC); fused, the product costs what its exponentials do.
template <typename TW>
static void glu(long M, const float* x, const TW* wg, const TW* wu, float* y, long N, int K, int threads) {
  const long blocks = N / V, Mp = padded(M);
  const float* xp = padded_rows(x, M, K, 1);
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks >= 2 * threads)
  for (long t = 0; t < blocks; t++) {
    static thread_local std::vector<float> scratch;
    if (scratch.size() < (std::size_t)2 * Mp * V) scratch.resize((std::size_t)2 * Mp * V);
    float* g = scratch.data();
    float* u = g + Mp * V;
    const long n = t * V;
    const bool next = n + 2 * V <= N;
    block(M, xp, wg + (std::size_t)n * K, g, K, V, 0, next, wg + (std::size_t)N * K);
    block(M, xp, wu + (std::size_t)n * K, u, K, V, 0, next, wu + (std::size_t)N * K);
    for (long m = 0; m < M; m++) {
      const vf a = loadu(g + m * V), b = loadu(u + m * V);
      const vf out = a / (1.0f + exp_lanes(-a)) * b;
      __builtin_memcpy(y + (std::size_t)m * N + n, &out, sizeof out);
    }
  }
  if (blocks * V < N) {                            // the columns past the last whole block
    const long left = N - blocks * V;
    std::vector<float> g(M * left), u(M * left);
    tail(M, x, wg + (std::size_t)blocks * V * K, g.data(), 0, left, left, K);
    tail(M, x, wu + (std::size_t)blocks * V * K, u.data(), 0, left, left, K);
    for (long m = 0; m < M; m++)
      for (long j = 0; j < left; j++) {
        const float a = g[m * left + j];
        y[(std::size_t)m * N + blocks * V + j] = a / (1.0f + std::exp(-a)) * u[m * left + j];
      }
  }
}

// y[i, :] = sum_l p[i, l] v[l, :] for i < RM: RM * D / V accumulators, one broadcast of p and
// D / V loads of v per slot l.
template <int RM, int D>
static inline void mix_tile(const float* __restrict p, const float* __restrict v, float* __restrict y, long L) {
  constexpr int C = D / V;
  vf acc[RM][C];
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++)
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) acc[i][c] = vf{};
  for (long l = 0; l < L; l++) {
    vf vv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) vv[c] = loadu(v + l * D + c * V);
#pragma GCC unroll 16
    for (int i = 0; i < RM; i++) {
      const vf pi = vf{} + p[i * L + l];
#pragma GCC unroll 16
      for (int c = 0; c < C; c++) acc[i][c] = fmadd(pi, vv[c], acc[i][c]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RM; i++)
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) __builtin_memcpy(y + i * D + c * V, &acc[i][c], VB);
}

// Batch b: y[b] = p[b] @ v[b], p [M, L] and y [M, D] contiguous, v's rows D apart and its
// batches vb apart. D is a multiple of V; query rows in tiles of 4, 2 or 1 as D / V grows
// (RM * D / V accumulators: 16 for D = 64 or 256 with AVX-512, 32 for D = 256 with AVX2).
template <int M, int D>
static void mix(const float* p, const float* v, float* y, int batches, long L, long vb, int threads) {
  static_assert(D % V == 0, "rows of whole vectors");
  constexpr int RM = D / V >= 16 ? 1 : D / V >= 8 ? 2 : 4;
  constexpr int tiles = (M + RM - 1) / RM;
  const int tasks = batches * tiles;
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks >= 2 * threads)
  for (int t = 0; t < tasks; t++) {
    const int b = t / tiles, m = (t % tiles) * RM;
    const float* pb = p + ((long)b * M + m) * L;
    const float* vb_ = v + b * vb;
    float* yb = y + ((long)b * M + m) * D;
    if (m + RM <= M) mix_tile<RM, D>(pb, vb_, yb, L);
    else for (int i = m; i < M; i++) mix_tile<1, D>(pb + (long)(i - m) * L, vb_, yb + (long)(i - m) * D, L);
  }
}

// The sum of p[0, n), threads each reading a contiguous share front to back into eight
// independent accumulators: no tiles, no software prefetch, nothing but loads and adds. Not
// part of any step: the roofline's probe of how fast this machine streams memory into its
// cores (`specfx.roofline`), the ceiling the kernels above are measured against.
static float stream_sum(const float* p, long n, int threads) {
  constexpr long C = 8 * V;
  const long chunks = n / C;
  float total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
  for (int t = 0; t < threads; t++) {
    vf acc[8] = {};
    for (long c = chunks * t / threads; c < chunks * (t + 1) / threads; c++)
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) acc[j] += loadu(p + c * C + j * V);
    for (int j = 1; j < 8; j++) acc[0] += acc[j];
    for (int l = 0; l < V; l++) total += acc[0][l];
  }
  for (long i = chunks * C; i < n; i++) total += p[i];
  return total;
}

// `iters` rounds of FMAs into A independent accumulators a thread (enough to cover the FMA
// units' latency), nothing read from memory: each thread does iters * A * V multiply-adds. Not
// part of any step: the roofline's probe of the machine's float32 FMA rate, the ceiling of a
// step whose rows make it compute-bound (a verify pass over many rows).
constexpr int FMA_ACCUMULATORS = 12;
static float fma_peak(long iters, int threads) {
  constexpr int A = FMA_ACCUMULATORS;
  float total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
  for (int t = 0; t < threads; t++) {
    vf acc[A];
    for (int j = 0; j < A; j++) acc[j] = vf{} + 1e-3f * (j + 1);
    vf a = vf{} + 0.999f, b = vf{} + 1e-4f;
    SPECFX_IN_REGISTER(a);
    SPECFX_IN_REGISTER(b);
    for (long i = 0; i < iters; i++)             // (an empty asm on each FMA here would cut the
#pragma GCC unroll 12                              // rate by three: it serializes them)
      for (int j = 0; j < A; j++) acc[j] = fmadd(acc[j], a, b);
    for (int j = 0; j < A; j++)
      for (int l = 0; l < V; l++) total += acc[j][l];
  }
  return total;
}

// Threads 0 and 1 of a parallel region pass one cache line back and forth `trips` times, each
// waiting for the other's write before it writes: the mean nanoseconds of a round trip, or -1
// where fewer than two threads run or a wait outlasts HANDOFF_SPINS reads (a thread descheduled:
// more threads than cores). Not part of any step: the probe of how far apart the kernels' threads
// sit. Every value one thread writes and the other reads in a step (a kernel's input written by
// the kernel before, half of it by the other thread; an OpenMP join) waits out such a trip.
// Where two threads share a last-level cache it takes tens of nanoseconds; between chiplets, each
// with its own cache and its own link to memory, several times that.
constexpr long HANDOFF_SPINS = 1L << 24;
static double handoff(long trips, int threads) {
  alignas(64) static std::atomic<long> turn;
  double ns = -1;
  turn.store(0);
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num();
    // Wait until `turn` holds `want`; false where the other gave up, or this one does.
    auto wait = [](long want) {
      for (long spins = 0;; spins++) {
        const long seen = turn.load(std::memory_order_acquire);
        if (seen == want) return true;
        if (seen < 0 || spins == HANDOFF_SPINS) {
          turn.store(-1, std::memory_order_release);
          return false;
        }
      }
    };
    if (omp_get_num_threads() >= 2 && trips > 0 && id < 2) {
      bool done = true;
      if (id == 1) {
        turn.store(1, std::memory_order_release);
        for (long i = 1; i <= trips && done; i++)
          if ((done = wait(2 * i))) turn.store(2 * i + 1, std::memory_order_release);
      } else if ((done = wait(1))) {
        const auto start = std::chrono::steady_clock::now();
        for (long i = 1; i <= trips && done; i++) {
          turn.store(2 * i, std::memory_order_release);
          done = wait(2 * i + 1);
        }
        if (done) ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / trips;
      }
    }
  }
#endif
  return ns;
}

}  // namespace specfx_tiled
#endif
