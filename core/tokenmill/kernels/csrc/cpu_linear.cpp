// A bfloat16 linear layer on CPU, y = x · Wᵀ, over a weight laid out once for AVX512-BF16's vdpbf16ps.
//
// The weight [N, K] is kept as [N/16][K/2][16][2] (N padded to 16, K to 2): for each block of 16 output
// features, every pair of input features is one 64-byte vector of 16 (feature, pair) products' operands,
// and a block is one contiguous stream. An x row's pair (x[k], x[k+1]) broadcast against that vector adds
// both products to 16 outputs at once in float32, with no horizontal sums. A task is up to 4 blocks
// (64 outputs) × up to 6 rows of x: 24 float32 accumulators held in registers over the whole K.
//
// A decode step of one sequence reads each weight once: on 2 cores this streams SmolLM2's weights at ~21 GB/s,
// where oneDNN's packed kernel read ~12 (python -m bench.linears; bench/RESULTS.md).
// Threads split the output blocks evenly, each reading its own part of the weight.
//
// x [M, K] contiguous bfloat16; blocked [N/16, K/2, 16, 2] bfloat16; returns [M, N], bfloat16 or (for an LM
// head, whose near-tied logits bfloat16 would round to ties) float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TOKENMILL_LINEAR 1
#endif

bool bf16_linear_built() {
#ifdef TOKENMILL_LINEAR
  return true;
#else
  return false;
#endif
}

#ifdef TOKENMILL_LINEAR
namespace {

constexpr int kRows = 6;      // rows of x a task keeps in registers
constexpr int kBlocks = 4;    // 16-feature blocks a task keeps in registers
constexpr int kPrefetch = 1024;  // bytes ahead in each block's stream

using bf16 = at::BFloat16;

inline void store(bf16* y, __mmask16 mask, __m512 values) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(values));
}

inline void store(float* y, __mmask16 mask, __m512 values) { _mm512_mask_storeu_ps(y, mask, values); }

// ROWS rows of x against BLOCKS consecutive blocks; `valid` of the 16 * BLOCKS outputs are stored.
template <int ROWS, int BLOCKS, typename Out>
inline void task(const bf16* x, int64_t K, const bf16* weight, int64_t block_elements, int64_t pairs, Out* y,
                 int64_t N, int64_t valid) {
  __m512 acc[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_setzero_ps();
  const int32_t* rows[ROWS];
  for (int r = 0; r < ROWS; ++r) rows[r] = reinterpret_cast<const int32_t*>(x + r * K);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    __m512bh w[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b) {
      const bf16* at = weight + b * block_elements + pair * 32;
      _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetch, _MM_HINT_T0);
      w[b] = (__m512bh)_mm512_loadu_si512(at);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh both = (__m512bh)_mm512_set1_epi32(rows[r][pair]);
      for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], w[b], both);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) {
      const int64_t left = valid - 16 * b;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      store(y + r * N + 16 * b, mask, acc[r][b]);
    }
}

// Every row of x against BLOCKS blocks starting at `first`.
template <int BLOCKS, typename Out>
void blocks(const bf16* x, int64_t M, int64_t K, const bf16* weight, int64_t pairs, Out* y, int64_t N,
            int64_t first) {
  const int64_t block_elements = pairs * 32;
  const bf16* w = weight + first * block_elements;
  const int64_t valid = std::min<int64_t>(16 * BLOCKS, N - first * 16);
  Out* out = y + first * 16;
  int64_t row = 0;
  for (; row + kRows <= M; row += kRows)
    task<kRows, BLOCKS, Out>(x + row * K, K, w, block_elements, pairs, out + row * N, N, valid);
  switch (M - row) {
#define TOKENMILL_ROWS(R) \
  case R: task<R, BLOCKS, Out>(x + row * K, K, w, block_elements, pairs, out + row * N, N, valid); break;
    TOKENMILL_ROWS(1) TOKENMILL_ROWS(2) TOKENMILL_ROWS(3) TOKENMILL_ROWS(4) TOKENMILL_ROWS(5)
#undef TOKENMILL_ROWS
    default: break;
  }
}

template <typename Out>
void linear(const bf16* x, int64_t M, int64_t K, const bf16* weight, int64_t pairs, int64_t total, Out* y,
            int64_t N) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread) {
      const int64_t first = total * thread / threads, last = total * (thread + 1) / threads;
      for (int64_t block = first; block < last; block += kBlocks) {
        switch (std::min<int64_t>(kBlocks, last - block)) {
          case 4: blocks<4>(x, M, K, weight, pairs, y, N, block); break;
          case 3: blocks<3>(x, M, K, weight, pairs, y, N, block); break;
          case 2: blocks<2>(x, M, K, weight, pairs, y, N, block); break;
          default: blocks<1>(x, M, K, weight, pairs, y, N, block); break;
        }
      }
    }
  });
}

}  // namespace
#endif

torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& blocked, int64_t out_features,
                             bool float_output) {
  TORCH_CHECK(bf16_linear_built(), "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous 2-D bfloat16 tensor");
  TORCH_CHECK(blocked.dim() == 4 && blocked.size(2) == 16 && blocked.size(3) == 2 &&
                  blocked.scalar_type() == at::kBFloat16 && blocked.is_contiguous(),
              "the weight must be blocked as [N/16, K/2, 16, 2] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), pairs = blocked.size(1), total = blocked.size(0);
  TORCH_CHECK(K % 2 == 0 && K / 2 == pairs, "x has ", K, " features; the weight takes ", 2 * pairs);
  TORCH_CHECK(out_features > 0 && out_features <= 16 * total && out_features > 16 * (total - 1),
              "out_features does not match the weight's blocks");
  auto y = torch::empty({M, out_features}, x.options().dtype(float_output ? at::kFloat : at::kBFloat16));
#ifdef TOKENMILL_LINEAR
  if (M == 0) return y;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = blocked.data_ptr<bf16>();
  if (float_output)
    linear(xp, M, K, wp, pairs, total, y.data_ptr<float>(), out_features);
  else
    linear(xp, M, K, wp, pairs, total, y.data_ptr<bf16>(), out_features);
#endif
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocked_linear", &blocked_linear, "x · Wᵀ over a weight blocked for vdpbf16ps (bfloat16, CPU)");
  m.def("bf16_linear_built", &bf16_linear_built, "whether this build has the AVX512-BF16 linear kernel");
}
