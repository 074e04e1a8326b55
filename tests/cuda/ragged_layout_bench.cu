// Standalone timing of the ragged layout kernel (csrc/maxattn/cudnn/ragged.cu),
// without JAX or cuDNN: equal-length causal documents, median of 50 event-timed
// launches, and a sanity line (first / last segment length, visible rows).
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -Icsrc tests/cuda/ragged_layout_bench.cu \
//        csrc/maxattn/cudnn/ragged.cu -o /tmp/ragged_layout_bench && /tmp/ragged_layout_bench
//   ncu --metrics gpu__time_duration.sum -k regex:RaggedLayout --launch-skip 20 --launch-count 1 \
//        /tmp/ragged_layout_bench      # device time of the first case
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "maxattn/cudnn/ragged.h"

using namespace maxattn::cudnn;
int main() {
  struct C { int B, T, D; } cases[] = {{2, 8192, 8}, {1, 65536, 16}, {4, 4096, 4}};
  for (auto c : cases) {
    std::vector<int32_t> ids(size_t(c.B) * c.T);
    for (int b = 0; b < c.B; ++b) for (int t = 0; t < c.T; ++t) ids[size_t(b) * c.T + t] = 1 + t / (c.T / c.D);
    int32_t* d_ids; cudaMalloc(&d_ids, ids.size() * 4); cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
    RaggedProblem p;
    p.rows.batch = c.B; p.rows.heads = 16; p.rows.q_len = c.T; p.rows.kv_len = c.T; p.rows.causal = true;
    p.max_segments = c.D; p.q_segment_ids = d_ids; p.kv_segment_ids = d_ids;
    p.q_token = p.k_token = p.v_token = p.o_token = 16 * 128;
    p.wide_offsets = NeedsWideOffsets(p);
    void* scratch; cudaMalloc(&scratch, RaggedLayoutBytes(p));
    RaggedLayout l = CarveRaggedLayout(p, scratch);
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    std::vector<float> ms;
    for (int i = 0; i < 60; ++i) {
      cudaEventRecord(e0); LaunchRaggedLayout(p, l, 0); cudaEventRecord(e1); cudaEventSynchronize(e1);
      float x; cudaEventElapsedTime(&x, e0, e1); if (i >= 10) ms.push_back(x);
    }
    std::sort(ms.begin(), ms.end());
    std::vector<int32_t> len(size_t(c.B) * c.D); cudaMemcpy(len.data(), l.seq_len_q, len.size() * 4, cudaMemcpyDeviceToHost);
    std::vector<uint8_t> rows(size_t(c.B) * c.T); cudaMemcpy(rows.data(), l.q_rows, rows.size(), cudaMemcpyDeviceToHost);
    long vis = 0; for (auto r : rows) vis += r == 1;
    std::printf("B=%d T=%d D=%d: median %.2f us (event), len0 %d lenlast %d visible %ld/%zu err %s\n", c.B, c.T, c.D,
                ms[ms.size() / 2] * 1e3, len[0], len.back(), vis, rows.size(), cudaGetErrorString(cudaGetLastError()));
    cudaFree(scratch); cudaFree(d_ids);
  }
}
