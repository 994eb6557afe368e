// Paged attention for decode rows on CPU: one query token per sequence, read straight from the
// block pool. Gathering each sequence's blocks into a padded buffer first (what SDPA needs) moves
// every KV byte three times; this reads each once, one sequence per task.
//
// query [seqs, heads, dim]; key_cache / value_cache [blocks, block_size, kv_heads, dim];
// block_tables [seqs, width] (int32); context_lens [seqs]. The query attends to positions
// [context - window, context) of its sequence (all of them when window is 0).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static void decode_rows(const T* query, const T* keys, const T* values, const int32_t* tables,
                        const int64_t* context, T* out, int64_t seqs, int64_t heads, int64_t kv_heads,
                        int64_t dim, int64_t block_size, int64_t table_width, int64_t window, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;  // one position's keys (or values) for all KV heads
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(heads * dim), acc(heads * dim), scores;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t length = context[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t n = length - first;
      const int32_t* table = tables + s * table_width;
      for (int64_t i = 0; i < heads * dim; ++i) q[i] = static_cast<float>(query[s * heads * dim + i]) * scale;
      scores.assign(heads * n, 0.f);
      for (int64_t p = first; p < length; ++p) {
        const T* k = keys + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * row;
        for (int64_t h = 0; h < heads; ++h) {
          const float* qh = q.data() + h * dim;
          const T* kh = k + (h / group) * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * static_cast<float>(kh[d]);
          scores[h * n + (p - first)] = dot;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* r = scores.data() + h * n;
        const float top = *std::max_element(r, r + n);
        float total = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          r[i] = std::exp(r[i] - top);
          total += r[i];
        }
        const float inverse = 1.f / total;
        for (int64_t i = 0; i < n; ++i) r[i] *= inverse;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = first; p < length; ++p) {
        const T* v = values + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * row;
        for (int64_t h = 0; h < heads; ++h) {
          const float w = scores[h * n + (p - first)];
          const T* vh = v + (h / group) * dim;
          float* a = acc.data() + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += w * static_cast<float>(vh[d]);
        }
      }
      for (int64_t i = 0; i < heads * dim; ++i) out[s * heads * dim + i] = static_cast<T>(acc[i]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, int64_t window, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [seqs, heads, dim], caches [blocks, size, kv_heads, dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and KV caches must share one dtype");
  const int64_t seqs = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.size(0) == seqs && context_lens.size(0) == seqs, "one table and length per sequence");
  auto q = query.contiguous();
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lengths = context_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(lengths.numel() == 0 || lengths.min().item<int64_t>() > 0, "every sequence needs context");
  TORCH_CHECK(lengths.numel() == 0 || lengths.max().item<int64_t>() <= tables.size(1) * block_size,
              "a context is longer than its block table");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_rows<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                          tables.data_ptr<int32_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), seqs,
                          heads, kv_heads, dim, block_size, tables.size(1), window, static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention of one query token per sequence (CPU)");
}
