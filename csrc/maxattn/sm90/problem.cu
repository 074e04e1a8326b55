// maxattn sm90: the host helpers of problem.h.
#include "maxattn/sm90/problem.h"

#include <string>

#include "maxattn/sm90/segments.h"

namespace maxattn::sm90 {
namespace {

__global__ void FillKernel(float* data, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    data[i] = value;
  }
}

int ClampWindow(int64_t w, int64_t limit) {
  if (w < 0) return -1;
  return static_cast<int>(w < limit ? w : limit);
}

struct SummarySizes {
  size_t key = 0, query = 0, run = 0, key_queries = 0;
};

SummarySizes Sizes(const ProblemArgs& args, bool key_block_queries) {
  SummarySizes s;
  s.key = static_cast<size_t>(args.batch) * args.num_n_blocks * sizeof(KeyBlockIds);
  s.query = static_cast<size_t>(args.batch) * args.num_m_blocks * sizeof(QueryBlockKeys);
  s.run = static_cast<size_t>(args.batch) * args.kv_len * sizeof(int32_t);
  if (key_block_queries) s.key_queries = static_cast<size_t>(args.batch) * args.num_n_blocks * sizeof(KeyBlockQueries);
  return s;
}

size_t RoundUp16(size_t n) { return (n + 15) / 16 * 16; }

}  // namespace

Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("sm90 attention: ") + what + ": " + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ")");
}

Status CheckSm90Device() {
  int device = 0, major = 0, minor = 0;
  MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                                     "cudaDeviceGetAttribute(major)"));
  MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                                     "cudaDeviceGetAttribute(minor)"));
  if (major != 9 || minor != 0) {
    return Status::Unimplemented("sm90 backend: needs a compute capability 9.0 GPU (found " +
                                 std::to_string(major) + "." + std::to_string(minor) + ")");
  }
  return Status::Ok();
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

Status FillFloats(float* data, int64_t n, float value, cudaStream_t stream) {
  if (data == nullptr || n == 0) return Status::Ok();
  const int64_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  FillKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(data, n, value);
  return CudaStatus(cudaGetLastError(), "fill kernel launch");
}

ProblemArgs MakeProblemArgs(const AttentionShape& shape, const AttentionOptions& options,
                            const AttentionInputs& inputs, int block_m, int block_n) {
  ProblemArgs a;
  const int64_t T = shape.q_len, S = shape.kv_len;
  a.q_lens = inputs.q_seq_lengths;
  a.kv_lens = inputs.kv_seq_lengths;
  a.batch = static_cast<int>(shape.batch);
  a.q_len = static_cast<int>(T);
  a.kv_len = static_cast<int>(S);
  a.heads = static_cast<int>(shape.num_q_heads);
  a.kv_heads = static_cast<int>(shape.num_kv_heads);
  a.group = static_cast<int>(shape.num_q_heads / shape.num_kv_heads);
  a.block_m = block_m;
  a.block_n = block_n;
  a.num_m_blocks = static_cast<int>((T + block_m - 1) / block_m);
  a.num_n_blocks = static_cast<int>((S + block_n - 1) / block_n);
  a.scale = options.scale;
  a.scale_log2 = static_cast<float>(static_cast<double>(options.scale) * 1.4426950408889634);
  if (options.softcap > 0.0f) {
    a.softcap = options.softcap;
    a.softcap_in = static_cast<float>(static_cast<double>(options.scale) / options.softcap);
    a.softcap_log2 = static_cast<float>(static_cast<double>(options.softcap) * 1.4426950408889634);
  }
  a.causal = options.causal;
  a.bottom_right = options.alignment == CausalAlignment::kBottomRight;
  a.window_left = ClampWindow(options.window_left, T + S);
  a.window_right = ClampWindow(options.window_right, T + S);
  return a;
}

size_t SegmentSummaryBytes(const ProblemArgs& args, bool key_block_queries) {
  const SummarySizes s = Sizes(args, key_block_queries);
  return s.key + s.query + RoundUp16(s.run) + s.key_queries;
}

Status PrepareSegments(const AttentionInputs& inputs, bool key_block_queries, void* scratch, cudaStream_t stream,
                       ProblemArgs* args) {
  const SummarySizes bytes = Sizes(*args, key_block_queries);
  char* base = static_cast<char*>(scratch);
  SegmentSummaryArgs s;
  s.q_ids = inputs.q_segment_ids;
  s.kv_ids = inputs.kv_segment_ids;
  s.q_lens = inputs.q_seq_lengths;
  s.kv_lens = inputs.kv_seq_lengths;
  s.batch = args->batch;
  s.q_len = args->q_len;
  s.kv_len = args->kv_len;
  s.block_m = args->block_m;
  s.block_n = args->block_n;
  // 16-byte records first, then the int32 run ends (rounded up), then the 8-byte key-block queries.
  s.key_blocks = reinterpret_cast<KeyBlockIds*>(base);
  s.query_blocks = reinterpret_cast<QueryBlockKeys*>(base + bytes.key);
  s.kv_run_end = reinterpret_cast<int32_t*>(base + bytes.key + bytes.query);
  if (key_block_queries) {
    s.key_block_queries = reinterpret_cast<KeyBlockQueries*>(base + bytes.key + bytes.query + RoundUp16(bytes.run));
  }
  args->q_segment_ids = inputs.q_segment_ids;
  args->kv_segment_ids = inputs.kv_segment_ids;
  args->key_blocks = s.key_blocks;
  args->query_blocks = s.query_blocks;
  args->kv_run_end = s.kv_run_end;
  args->key_block_queries = s.key_block_queries;
  return SummarizeSegments(s, stream);
}

}  // namespace maxattn::sm90
