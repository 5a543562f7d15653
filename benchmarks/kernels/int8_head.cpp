// The int8 kernels over the linears of one pycoder MTP head pass (eh_proj, q/k/v and gate/up as
// grouped kernels, o, down, the lm_head), two builds of `tiled_linear.h` side by side in one
// process (say, the current one and the one before c4882c6, which gave its rows one pointer each),
// round-robin, median of 600 rounds of 5 passes each; checks that both give the same bits.
//   H=specfx/kernels/tiled_linear.h; git show c4882c6~1:$H > /tmp/before.h
//   for v in a:/tmp/before.h b:$PWD/$H; do g++ -O3 -march=native -fopenmp -std=c++17 -c -DHDR="\"${v#*:}\""
//     -DNS=ns_${v%%:*} -DFN=pass_${v%%:*} benchmarks/kernels/int8_head.cpp -o /tmp/${v%%:*}.o; done   (one line)
//   g++ -O3 -march=native -fopenmp -DMAIN benchmarks/kernels/int8_head.cpp /tmp/a.o /tmp/b.o -o /tmp/int8_head
//   /tmp/int8_head ROWS THREADS
#include <cstdint>
#ifndef MAIN
#define SPECFX_AHEAD_LOCALITY 2
#define specfx_tiled NS
#include HDR
// Sizes and thread counts as literals, as Inductor writes its calls.
template <int T>
static void pass(long M, const int8_t* const* w, const float* x, float* y) {
  using namespace NS;
  const int8_t* qkv[] = {w[1], w[1] + 320 * 320, w[1] + 2 * 320 * 320};
  const int8_t* gate_up[] = {w[3], w[3] + 864 * 320};
  const long n3[] = {320, 320, 320}, n2[] = {864, 864};
  linear(M, x, w[0], y, 1, 320, 640, 0, T);
  linears<3>(M, x, qkv, n3, y, 320, T);
  linear(M, x, w[2], y, 1, 320, 320, 0, T);
  linears<2>(M, x, gate_up, n2, y, 320, T);
  linear(M, x, w[4], y, 1, 320, 864, 0, T);
  linear(M, x, w[5], y, 1, 4096, 320, 0, T);
}
extern "C" void FN(long M, int threads, const int8_t* const* w, const float* x, float* y) {
  if (threads == 1) pass<1>(M, w, x, y);
  else pass<2>(M, w, x, y);
}
#else
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
typedef void Pass(long, int, const int8_t* const*, const float*, float*);
extern "C" Pass pass_a, pass_b;
int main(int argc, char** argv) {
  const long M = argc > 1 ? atol(argv[1]) : 1;
  const int threads = argc > 2 ? atoi(argv[2]) : 2;
  const long sizes[] = {320 * 640, 3 * 320 * 320, 320 * 320, 2 * 864 * 320, 320 * 864, 4096 * 320};
  std::vector<std::vector<int8_t>> ws;
  const int8_t* w[6];
  for (int i = 0; i < 6; i++) {
    ws.emplace_back(sizes[i]);
    for (auto& b : ws.back()) b = (int8_t)(rand() % 255 - 127);
    w[i] = ws.back().data();
  }
  std::vector<float> x(16 * 864), ya(16 * 4096), yb(16 * 4096);
  for (auto& v : x) v = (rand() % 2000 - 1000) * 1e-3f;
  pass_a(M, threads, w, x.data(), ya.data());
  pass_b(M, threads, w, x.data(), yb.data());
  const bool same = std::equal(ya.begin(), ya.begin() + 4096 * M, yb.begin());
  Pass* fs[2] = {pass_a, pass_b};
  std::vector<double> t[2];
  for (int r = 0; r < 600; r++)
    for (int i = 0; i < 2; i++) {
      const int v = (r + i) % 2;
      auto t0 = std::chrono::steady_clock::now();
      for (int rep = 0; rep < 5; rep++) fs[v](M, threads, w, x.data(), ya.data());
      t[v].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 5);
    }
  for (auto& ts : t) std::sort(ts.begin(), ts.end());
  printf("%ld row(s), %d thread(s): a %.2f us, b %.2f us a pass (median); same bits: %s\n", M, threads, t[0][300],
         t[1][300], same ? "yes" : "NO");
  return same ? 0 : 1;
}
#endif
