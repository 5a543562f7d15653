// What the placement of the two threads changes, measured set by set and grouped by the round
// trip of a cache line between them (the header's `handoff`; below 150 ns "near", else "far",
// as is a round trip that gave up).
// Each set, after its round trip:
//   fma     each thread alone, 12 chains of multiply-adds in registers (GFLOP/s, threads 0 / 1);
//   read    each thread alone, the header's `stream_sum` over its own 31.5 MB (GB/s, 0 / 1);
//   c8      each thread alone, `linear` at 8 rows, threads = 1, over its own 432 x 320 float32
//           weight (half of a layer's gate) 57 times, in cache (GFLOP/s, 0 / 1);
//   s4, s8  the same over 57 different copies of that weight (31.5 MB a thread), 4 and 8 rows;
//   p4, p8  the same stream with each group of four weight rows packed side by side along K (a
//           tile's weight vectors then one sequential stream; the same products, to the bit);
//   call4, call8  both threads, one `linear` call over a 864 x 320 weight in cache at 4 and 8
//           rows (us a call, median of 9 runs of 50 calls): what a kernel of a step pays.
// At the end, each group's mean of every column.
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/kernels/placement.cpp -o /tmp/placement
//   /tmp/placement SECONDS
// Against another build of the header: -DHDR='"/path/to/tiled_linear.h"'.
#define SPECFX_AHEAD_LOCALITY 2
#ifndef HDR
#define HDR "../../specfx/kernels/tiled_linear.h"
#endif
#include HDR
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>
#include <omp.h>

using namespace specfx_tiled;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

constexpr int K = 320, N = 432, COPIES = 57;

// The packed layout: weight rows 4g..4g+3, for each vector k of K, side by side (4 x V floats).
static std::vector<float> pack(const std::vector<float>& w) {
  std::vector<float> p(w.size());
  for (int c = 0; c < COPIES; c++)
    for (int g = 0; g < N / 4; g++)
      for (int s = 0; s < K / V; s++)
        for (int r = 0; r < 4; r++)
          for (int l = 0; l < V; l++)
            p[(std::size_t)c * N * K + (((std::size_t)g * (K / V) + s) * 4 + r) * V + l] =
                w[(std::size_t)c * N * K + (std::size_t)(g * 4 + r) * K + s * V + l];
  return p;
}

// A tile of 4 query rows x 4 packed weight rows, prefetching AHEAD bytes ahead as the header's
// tiles of four do, its sums reduced and stored as theirs are.
static __attribute__((noinline)) void packed_tile(const float* x, const float* wg, float* y, const float* end) {
  vf acc[V];
  for (int a = 0; a < V; a++) acc[a] = vf{};
  for (int k = 0; k < K; k += V) {
    const char* ahead = (const char*)(wg + 4 * k) + AHEAD;
    for (int q = 0; q < 4; q++)
      if (ahead + 64 * q < (const char*)end) __builtin_prefetch(ahead + 64 * q, 0, SPECFX_AHEAD_LOCALITY);
    step<4, 4>(acc, x + k, K, wg + 4 * k, V);
  }
  vf r = reduce<V / 2, 0, 1>(acc);
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 4; j++) y[(std::size_t)i * N + j] = r[i * 4 + j];
}

// `linear` over one packed weight: each group of four weight rows through every tile of four
// query rows in turn, as the header's stream of a verify's rows goes.
static void packed_linear(long M, const float* x, const float* wp, float* y) {
  for (int g = 0; g < N / 4; g++)
    for (long m = 0; m < M; m += 4) packed_tile(x + m * K, wp + (std::size_t)g * 4 * K, y + m * N + g * 4, wp + (std::size_t)N * K);
}

// Each thread's own rate (units per second) of `work(thread)`, median of 5 after a barrier.
template <class F> static void alone(double units, F work, double* out) {
#pragma omp parallel num_threads(2)
  {
    const int id = omp_get_thread_num();
    std::vector<double> ts;
    for (int rep = 0; rep < 5; rep++) {
#pragma omp barrier
      const double t0 = now();
      work(id);
      ts.push_back(now() - t0);
    }
    std::sort(ts.begin(), ts.end());
    out[id] = units / ts[2] * 1e-9;
  }
}

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? atof(argv[1]) : 60;
  std::vector<float> w[2], p[2];
  for (int t = 0; t < 2; t++) {
    w[t].resize((std::size_t)COPIES * N * K);
    for (auto& v : w[t]) v = (std::rand() % 1000 - 500) / 5000.f;
    p[t] = pack(w[t]);
  }
  {                                               // the packed kernel's products are `linear`'s
    std::vector<float> x(8 * K), a(8 * N), b(8 * N);
    for (auto& v : x) v = (std::rand() % 1000) / 1000.f;
    linear<float>(8, x.data(), w[0].data(), a.data(), 1, N, K, 0, 1);
    packed_linear(8, x.data(), p[0].data(), b.data());
    if (a != b) { std::printf("packed products differ\n"); return 1; }
  }
  std::vector<float> wide((std::size_t)2 * N * K);
  for (auto& v : wide) v = (std::rand() % 1000 - 500) / 5000.f;
  std::map<std::string, std::vector<double>> sums[2];
  int sets[2] = {0, 0};
  const double end = now() + seconds;
  while (now() < end) {
    const double ns = handoff(5000, 2);
    const int far = ns < 0 || ns >= 150;             // a round trip that gave up (-1) counts as far
    std::vector<std::pair<std::string, double>> row;
    double r[2];
    auto add = [&](const char* name, double a, double b) { row.push_back({std::string(name) + " 0", a}); row.push_back({std::string(name) + " 1", b}); };
    alone(2.0 * 16 * 12 * 2000000, [](int) {
      vf a[12];
      for (int i = 0; i < 12; i++) a[i] = vf{} + 1e-3f * (i + 1);
      vf m = vf{} + 0.999f, c = vf{} + 1e-4f;
      SPECFX_IN_REGISTER(m);
      SPECFX_IN_REGISTER(c);
      for (long it = 0; it < 2000000; it++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = fmadd(a[i], m, c);
      float s = 0;
      for (int i = 0; i < 12; i++) s += a[i][0];
      if (s == 1.234f) std::printf("!");
    }, r);
    add("fma", r[0], r[1]);
    alone(4.0 * COPIES * N * K, [&](int id) {
      if (stream_sum(w[id].data(), (long)COPIES * N * K, 1) == 1.234f) std::printf("!");
    }, r);
    add("read", r[0], r[1]);
    for (int kind = 0; kind < 3; kind++)
      for (int M : {4, 8}) {
        if (kind == 0 && M == 4) continue;
        std::vector<float> x[2] = {std::vector<float>(M * K, 0.01f), std::vector<float>(M * K, 0.01f)};
        std::vector<float> y[2] = {std::vector<float>(M * N), std::vector<float>(M * N)};
        alone(2.0 * M * N * K * COPIES, [&](int id) {
          for (int c = 0; c < COPIES; c++) {
            const std::size_t at = kind == 0 ? 0 : (std::size_t)c * N * K;
            if (kind == 2) packed_linear(M, x[id].data(), p[id].data() + at, y[id].data());
            else linear<float>(M, x[id].data(), w[id].data() + at, y[id].data(), 1, N, K, 0, 1);
          }
        }, r);
        add((std::string(kind == 0 ? "c" : kind == 1 ? "s" : "p") + std::to_string(M)).c_str(), r[0], r[1]);
      }
    for (int M : {4, 8}) {
      std::vector<float> x(M * K, 0.01f), y(M * 2 * N);
      std::vector<double> ts;
      for (int rep = 0; rep < 9; rep++) {
        const double t0 = now();
        for (int c = 0; c < 50; c++) linear<float>(M, x.data(), wide.data(), y.data(), 1, 2 * N, K, 0, 2);
        ts.push_back((now() - t0) / 50 * 1e6);
      }
      std::sort(ts.begin(), ts.end());
      row.push_back({"call" + std::to_string(M), ts[4]});
    }
    std::printf("%4.0f ns", ns);
    for (auto& [name, v] : row) std::printf("  %s %.1f", name.c_str(), v);
    std::printf("\n");
    std::fflush(stdout);
    sets[far]++;
    for (auto& [name, v] : row) sums[far][name].push_back(v);
  }
  for (int far = 0; far < 2; far++) {
    if (!sets[far]) continue;
    std::printf("%s: %d sets, means:", far ? "far (round trip >= 150 ns)" : "near (round trip < 150 ns)", sets[far]);
    for (auto& [name, v] : sums[far]) {
      double s = 0;
      for (double e : v) s += e;
      std::printf("  %s %.1f", name.c_str(), s / v.size());
    }
    std::printf("\n");
  }
}
