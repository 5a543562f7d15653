// The tiled kernel over the weights of one pycoder MTP head pass (eh_proj, the layer, the lm_head),
// float32 against bfloat16 weights, 2 threads, median of 400 round-robin passes:
//   g++ -O3 -march=native -fopenmp -Ispecfx/kernels benchmarks/kernels/bf16_weights.cpp -o /tmp/bf16 && /tmp/bf16
#include "tiled_linear.h"
#include <chrono>
#include <vector>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
using namespace specfx_tiled;
struct Wt { int N, K; std::vector<float> f; std::vector<uint16_t> b; };
int main(int argc, char** argv) {
  int shapes[][2] = {{320,640},{320,320},{320,320},{320,320},{320,320},{864,320},{864,320},{320,864},{4096,320}};
  std::vector<Wt> ws;
  for (auto& s : shapes) {
    Wt w{s[0], s[1]};
    w.f.resize((size_t)s[0]*s[1]); w.b.resize(w.f.size());
    for (size_t i = 0; i < w.f.size(); i++) { w.f[i] = (rand() % 1000 - 500) / 5000.f; unsigned u; __builtin_memcpy(&u, &w.f[i], 4); w.b[i] = u >> 16; }
    ws.push_back(std::move(w));
  }
  std::vector<float> x(16 * 864, 0.01f), y(16 * 4096);
  for (int M : {1, 4, 5}) {
    for (int rep = 0; rep < 3; rep++) {
      double best[2] = {1e9, 1e9};
      std::vector<double> ts[2];
      for (int it = 0; it < 400; it++) {
        for (int kind = 0; kind < 2; kind++) {
          auto t0 = std::chrono::steady_clock::now();
          for (auto& w : ws) {
            if (kind == 0) linear(M, x.data(), w.f.data(), y.data(), 1, w.N, w.K, 0, 2);
            else linear(M, x.data(), w.b.data(), y.data(), 1, w.N, w.K, 0, 2);
            x[0] += y[0] * 1e-9f;
          }
          auto t1 = std::chrono::steady_clock::now();
          ts[kind].push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
      }
      for (int k = 0; k < 2; k++) { std::sort(ts[k].begin(), ts[k].end()); }
      printf("M=%d fp32 %.1f us  bf16 %.1f us\n", M, ts[0][200], ts[1][200]);
    }
  }
}
