// specfx's few-query attention over a span of a KV cache: for each head, scores, their masked
// softmax and the weighted sum of values in one pass of one thread, so that a head's keys and
// values are read once while they are in the thread's cache, and one parallel region covers the
// layer's attention (three before: the scores, the softmax, the mix, each split among the threads
// on its own, with a join after each).
//
// Built on tiled_linear.h (the scores are its `block`s of V keys, the values its `mix_tile`) and
// on ATen's vectorized exp, the one Inductor's softmax calls, so that only the order of the sums
// differs from the unfused form. Compiled into a step's graph only (cpp_prefix.h comes first).
#ifndef SPECFX_TILED_ATTEND_H
#define SPECFX_TILED_ATTEND_H
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace specfx_tiled {

// s[0, L) <- softmax of scale * s + bias (0 where a slot is seen, -inf where it is masked), as
// torch computes it: exp(x - max) / sum.
static inline void masked_softmax(float* s, const float* bias, long L, float scale) {
  using Vec = at::vec::Vectorized<float>;
  constexpr long S = Vec::size();
  const Vec vscale(scale);
  Vec vtop(-INFINITY);
  long l = 0;
  for (; l + S <= L; l += S) {
    const Vec x = Vec::loadu(s + l) * vscale + Vec::loadu(bias + l);
    x.store(s + l);
    vtop = at::vec::maximum(vtop, x);
  }
  float lanes[S];
  vtop.store(lanes);
  float top = -INFINITY;
  for (long i = 0; i < S; i++) top = std::max(top, lanes[i]);
  for (; l < L; l++) {
    s[l] = s[l] * scale + bias[l];
    top = std::max(top, s[l]);
  }
  vtop = Vec(top);
  Vec vsum(0.f);
  l = 0;
  for (; l + S <= L; l += S) {
    const Vec e = (Vec::loadu(s + l) - vtop).exp();
    e.store(s + l);
    vsum = vsum + e;
  }
  vsum.store(lanes);
  float sum = 0;
  for (long i = 0; i < S; i++) sum += lanes[i];
  if (l < L) {
    const Vec e = (Vec::loadu(s + l, L - l) - vtop).exp();
    e.store(s + l, L - l);
    for (long i = l; i < L; i++) sum += s[i];
  }
  const Vec vsum_all(sum);
  for (l = 0; l + S <= L; l += S) (Vec::loadu(s + l) / vsum_all).store(s + l);
  if (l < L) (Vec::loadu(s + l, L - l) / vsum_all).store(s + l, L - l);
}

// RM query rows q [RM, D] of one head over L slots: scores into s [RM, L], each row softmaxed
// with its bias (`mask(i)`: L floats, 0 or -inf), then y [RM, D] = s . v.
template <int RM, int D, class Mask>
static inline void attend_rows(const float* q, const float* k, const float* v, float* s, float* y, long L,
                               float scale, Mask mask) {
  const long whole = L / V * V;
  for (long n = 0; n < whole; n += V) block(RM, q, k, s, D, (int)L, (int)n, n + 2 * V <= L, k + L * D);
  for (long n = whole; n < L; n++)                      // slots past the last whole block
    for (int i = 0; i < RM; i++) {
      float acc = 0;
      for (int d = 0; d < D; d++) acc += q[i * D + d] * k[n * D + d];
      s[i * L + n] = acc;
    }
  for (int i = 0; i < RM; i++) masked_softmax(s + i * L, mask(i), L, scale);
  mix_tile<RM, D>(s, v, y, L);
}

// y[h, r] = softmax(scale * q[h, r] . k[h, l] over the slots l < L that query r sees) . v[h]
// for `heads` = B * Hkv heads of R query rows each (a kv head's query heads, G * W rows: row r
// is query r % W of its batch). q and y [heads, R, D] contiguous; k and v rows D apart, heads kb
// and vb apart (a span of a KV cache); bias [B, W, L], 0 where a query sees a slot and -inf
// where not. Threads split the (head, tile of RM rows) pairs; rows left over after the whole
// tiles run as one more tile of RM, padded (a 5-row verify of a chain of 4 drafts: 1.63-1.70x
// the decode graph with each left-over row a pass of its own over the head's keys and values,
// 1.18-1.25x with this and the linears' padding, round-robin in one process).
template <int RM, int D>
static void attend(const float* q, const float* k, long kb, const float* v, long vb, const float* bias, float* y,
                   int heads, int hkv, int R, int W, long L, float scale, int threads) {
  static_assert(D % V == 0, "rows of whole vectors");
  const int tiles = (R + RM - 1) / RM, tasks = heads * tiles;
#pragma omp parallel num_threads(threads) if (tasks >= 2 * threads)
  {
    std::vector<float> scratch((std::size_t)RM * L);
    float* s = scratch.data();
#pragma omp for schedule(static) nowait           // the region's end is the barrier
    for (int t = 0; t < tasks; t++) {
      const int h = t / tiles, r0 = (t % tiles) * RM;
      const float* batch = bias + (long)(h / hkv) * W * L;
      const float* qt = q + ((long)h * R + r0) * D;
      float* yt = y + ((long)h * R + r0) * D;
      if (r0 + RM <= R) {
        attend_rows<RM, D>(qt, k + h * kb, v + h * vb, s, yt, L, scale,
                           [&](int i) { return batch + (long)((r0 + i) % W) * L; });
      } else {                                      // the last rows: a tile of RM whose extra rows
        const int n = R - r0;                       // repeat the last one, their outputs dropped
        float qp[RM * D], yp[RM * D];
        for (int i = 0; i < RM; i++) std::memcpy(qp + i * D, qt + (long)std::min(i, n - 1) * D, sizeof(float) * D);
        attend_rows<RM, D>(qp, k + h * kb, v + h * vb, s, yp, L, scale,
                           [&](int i) { return batch + (long)((r0 + std::min(i, n - 1)) % W) * L; });
        std::memcpy(yt, yp, sizeof(float) * n * D);
      }
    }
  }
}

}  // namespace specfx_tiled
#endif
