// The float32 tiled kernel over a pycoder-sized weight stream, by query rows: 57 copies of an
// 864 x 320 matrix (63 MB; pycoder's float32 weights are 64.7 MB), one `linear` call a copy, at
// 1, 4, 8, 12 and 16 rows, two threads; with `cache`, one copy (1.1 MB: half in each core's L2)
// called 57 times; with `huge`, the 57 copies in one buffer in 2 MB pages (as a compiled step's
// weights are: `runtime.memory.huge_pages`; transparent huge pages in "madvise" or "always"
// mode). Builds of `tiled_linear.h` side by side in one process (each in its own namespace),
// round-robin, median of 300 rounds; prints ms, GB/s and GFLOP/s for each.
// One build (the current header):
//   H=$PWD/specfx/kernels/tiled_linear.h
//   g++ -O3 -march=native -fopenmp -std=c++17 -c -DHDR="\"$H\"" -DNS=ns_a -DFN=run_a benchmarks/kernels/stream_rows.cpp -o /tmp/a.o
//   g++ -O3 -march=native -fopenmp -std=c++17 -DMAIN -DBUILDS=1 benchmarks/kernels/stream_rows.cpp /tmp/a.o -o /tmp/stream_rows
//   /tmp/stream_rows [cache|huge]
// Two (a header to try as /tmp/try.h): the same for -DNS=ns_b -DFN=run_b into /tmp/b.o, then
// -DBUILDS=2 and both objects.
#include <cstddef>
#ifndef MAIN
#define SPECFX_AHEAD_LOCALITY 2
#define specfx_tiled NS
#include HDR
void FN(long M, const float* x, float* const* w, int copies, int N, int K, float* y) {
  for (int c = 0; c < copies; c++) NS::linear<float>(M, x, w[c], y, 1, N, K, 0, 2);
}
#else
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <sys/mman.h>
void run_a(long, const float*, float* const*, int, int, int, float*);
#if BUILDS > 1
void run_b(long, const float*, float* const*, int, int, int, float*);
#endif
int main(int argc, char** argv) {
  const int N = 864, K = 320, copies = 57;
  const bool cache = argc > 1 && !std::strcmp(argv[1], "cache"), huge = argc > 1 && !std::strcmp(argv[1], "huge");
  const std::size_t page = 2 << 20, bytes = ((cache ? 1 : copies) * sizeof(float) * N * K + page - 1) / page * page;
  float* all = (float*)std::aligned_alloc(page, bytes);
  madvise(all, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  for (std::size_t i = 0; i < bytes / sizeof(float); i++) all[i] = (std::rand() % 1000 - 500) / 5000.f;
  std::vector<float*> ptrs;
  for (int c = 0; c < copies; c++) ptrs.push_back(all + (cache ? 0 : (std::size_t)c * N * K));
  void (*runs[])(long, const float*, float* const*, int, int, int, float*) = {run_a,
#if BUILDS > 1
                                                                              run_b
#endif
  };
  const int builds = sizeof runs / sizeof runs[0];
  std::printf("%s, %d copies of %d x %d float32, 2 threads, median of 300 round-robin rounds\n",
              cache ? "one copy in cache" : huge ? "streamed, 2 MB pages" : "streamed, 4 KB pages", copies, N, K);
  for (int M : {1, 4, 8, 12, 16}) {
    std::vector<float> x((std::size_t)M * K, 0.01f), y((std::size_t)M * N);
    std::vector<double> ts[2];
    for (int r = 0; r < 300; r++)
      for (int i = 0; i < builds; i++) {
        const int b = (i + r) % builds;
        auto t0 = std::chrono::steady_clock::now();
        runs[b](M, x.data(), ptrs.data(), copies, N, K, y.data());
        ts[b].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    std::printf("%2d rows:", M);
    for (int b = 0; b < builds; b++) {
      std::sort(ts[b].begin(), ts[b].end());
      const double t = ts[b][ts[b].size() / 2];
      std::printf("  %c %.3f ms %5.1f GB/s %6.1f GFLOP/s", 'a' + b, t * 1e3, 4.0 * N * K * copies / t * 1e-9,
                  2.0 * M * N * K * copies / t * 1e-9);
    }
    std::printf("\n");
  }
}
#endif
