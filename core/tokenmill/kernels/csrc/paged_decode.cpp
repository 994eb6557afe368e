// Paged attention for decode rows on CPU: one query token per sequence, read straight from the
// block pool. Gathering each sequence's blocks into a padded buffer first (what SDPA needs) moves
// every KV byte three times; this reads each once.
//
// query [seqs, heads, dim]; key_cache / value_cache [blocks, block_size, kv_heads, dim];
// block_tables [seqs, width] (int32); context_lens [seqs]. The query attends to positions
// [context - window, context) of its sequence (all of them when window is 0).
//
// One task per sequence reads its key rows, then its value rows, once each in position order
// (in memory order within each block), every head using a row while it is in L1; the layouts
// tried before this one are in bench/RESULTS.md. Where torch reports AVX2 the build adds AVX2, FMA
// and F16C; then the exponentials, and where dim is a multiple of 8 the dot products and the
// value sums, run eight lanes at a time. Where it reports AVX512 the build adds AVX512 F/BW/VL/DQ,
// and the dot products and value sums run sixteen lanes at a time where dim is a multiple of 16;
// where the CPU also has AVX512-BF16, bfloat16 scores are dot products of bfloat16 pairs
// (vdpbf16ps: 32 products an instruction, summed in float32) where dim is a multiple of 32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_AVX2 1
#endif

#if defined(TOKENMILL_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define TOKENMILL_AVX512 1
#endif
#if defined(TOKENMILL_AVX512) && defined(__AVX512BF16__)
#define TOKENMILL_AVX512_BF16 1
#endif

namespace {

#ifdef TOKENMILL_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
float dot16(const float* q, const T* row, int64_t dim) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(row + d), a);
  return _mm512_reduce_add_ps(a);
}

template <typename T>
void axpy16(float weight, const T* row, int64_t dim, float* acc) {
  const __m512 w = _mm512_set1_ps(weight);
  for (int64_t d = 0; d < dim; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(w, load16(row + d), _mm512_loadu_ps(acc + d)));
}
#endif

#ifdef TOKENMILL_AVX512_BF16
// q . row for bfloat16 rows, dim a multiple of 32: each instruction multiplies 32 pairs and adds
// them, in float32, into 16 lanes.
inline float dot_bf16(const at::BFloat16* q, const at::BFloat16* row, int64_t dim) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 32) {
    const __m512i x = _mm512_loadu_si512(q + d), y = _mm512_loadu_si512(row + d);
    a = _mm512_dpbf16_ps(a, reinterpret_cast<const __m512bh&>(x), reinterpret_cast<const __m512bh&>(y));
  }
  return _mm512_reduce_add_ps(a);
}
#endif

#ifdef TOKENMILL_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <typename T>
constexpr bool has_vector_loads =
    std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

inline float sum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x for x <= 0 (scores minus their maximum): Cody-Waite range reduction and Cephes' expf
// polynomial; inputs below -87 give ~1e-38 instead of underflowing.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // x second: a NaN stays NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

template <typename T>
float dot(const float* q, const T* row, int64_t dim) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(row + d), a);
  return sum8(a);
}

// acc[0:dim] += weight * row[0:dim]
template <typename T>
void axpy(float weight, const T* row, int64_t dim, float* acc) {
  const __m256 w = _mm256_set1_ps(weight);
  for (int64_t d = 0; d < dim; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, load8(row + d), _mm256_loadu_ps(acc + d)));
}

// Turns scores into unnormalised softmax weights in place; returns their sum.
inline float exponentiate(float* scores, int64_t n) {
  const float top = *std::max_element(scores, scores + n);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), shift));
    _mm256_storeu_ps(scores + i, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = sum8(total8);
  for (; i < n; ++i) total += (scores[i] = std::exp(scores[i] - top));
  return total;
}
#endif

template <typename T>
float dot_scalar(const float* q, const T* row, int64_t dim) {
  float dot = 0.f;
  for (int64_t d = 0; d < dim; ++d) dot += q[d] * static_cast<float>(row[d]);
  return dot;
}

template <typename T>
void axpy_scalar(float weight, const T* row, int64_t dim, float* acc) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += weight * static_cast<float>(row[d]);
}

inline float exponentiate_scalar(float* scores, int64_t n) {
  const float top = *std::max_element(scores, scores + n);
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += (scores[i] = std::exp(scores[i] - top));
  return total;
}

// How a row's dot products and value sums run: the widest path this build and dim allow.
enum class Path { kScalar, kAvx2, kAvx512, kBf16Pairs };

template <typename T>
Path path_for(int64_t dim) {
#ifdef TOKENMILL_AVX512_BF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (dim % 32 == 0) return Path::kBf16Pairs;
  }
#endif
#ifdef TOKENMILL_AVX512
  if constexpr (has_vector_loads<T>) {
    if (dim % 16 == 0) return Path::kAvx512;
  }
#endif
#ifdef TOKENMILL_AVX2
  if constexpr (has_vector_loads<T>) {
    if (dim % 8 == 0) return Path::kAvx2;
  }
#endif
  return Path::kScalar;
}

// scores[h * n] = q[h] . row[(h / group) * dim] for each query head h. The bfloat16 pairs path reads
// the unscaled query in bfloat16 (query_bf16) and scales each score after.
template <typename T>
void score(Path path, const float* q, const T* query_bf16, float scale, const T* row, int64_t heads, int64_t group,
           int64_t dim, float* scores, int64_t n) {
#ifdef TOKENMILL_AVX512_BF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (path == Path::kBf16Pairs) {
      for (int64_t h = 0; h < heads; ++h) scores[h * n] = scale * dot_bf16(query_bf16 + h * dim, row + h / group * dim, dim);
      return;
    }
  }
#endif
#ifdef TOKENMILL_AVX512
  if constexpr (has_vector_loads<T>) {
    if (path == Path::kAvx512) {
      for (int64_t h = 0; h < heads; ++h) scores[h * n] = dot16(q + h * dim, row + h / group * dim, dim);
      return;
    }
  }
#endif
#ifdef TOKENMILL_AVX2
  if constexpr (has_vector_loads<T>) {
    if (path == Path::kAvx2) {
      for (int64_t h = 0; h < heads; ++h) scores[h * n] = dot(q + h * dim, row + h / group * dim, dim);
      return;
    }
  }
#endif
  for (int64_t h = 0; h < heads; ++h) scores[h * n] = dot_scalar(q + h * dim, row + h / group * dim, dim);
}

// acc[h] += weights[h * n] * row[(h / group) * dim] for each query head h.
template <typename T>
void sum_values(Path path, const float* weights, const T* row, int64_t heads, int64_t group, int64_t dim, float* acc,
                int64_t n) {
#ifdef TOKENMILL_AVX512
  if constexpr (has_vector_loads<T>) {
    if (path == Path::kAvx512 || path == Path::kBf16Pairs) {
      for (int64_t h = 0; h < heads; ++h) axpy16(weights[h * n], row + h / group * dim, dim, acc + h * dim);
      return;
    }
  }
#endif
#ifdef TOKENMILL_AVX2
  if constexpr (has_vector_loads<T>) {
    if (path != Path::kScalar) {
      for (int64_t h = 0; h < heads; ++h) axpy(weights[h * n], row + h / group * dim, dim, acc + h * dim);
      return;
    }
  }
#endif
  for (int64_t h = 0; h < heads; ++h) axpy_scalar(weights[h * n], row + h / group * dim, dim, acc + h * dim);
}

inline float softmax_weights(float* scores, int64_t n) {
#ifdef TOKENMILL_AVX2
  return exponentiate(scores, n);
#else
  return exponentiate_scalar(scores, n);
#endif
}

struct Shape {
  int64_t heads, kv_heads, dim, block_size, table_width, window;
  float scale;
};

// Calls visit(offset of the position from the window's start, its cache row) for each position
// in the window, in order.
template <typename Visit>
void for_each_position(const int32_t* table, int64_t first, int64_t length, int64_t block_size, Visit visit) {
  for (int64_t p = first; p < length; ++p)
    visit(p - first, static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size);
}

template <typename T>
void decode_rows(const T* query, const T* keys, const T* values, const int32_t* tables, const int64_t* context,
                 T* out, int64_t seqs, const Shape& shape) {
  const int64_t group = shape.heads / shape.kv_heads, dim = shape.dim;
  const int64_t row = shape.kv_heads * dim;  // one position's keys (or values) for all KV heads
  const Path path = path_for<T>(dim);
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(shape.heads * dim), acc(shape.heads * dim), scores, inverse(shape.heads);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t length = context[s];
      const int64_t first = shape.window > 0 ? std::max<int64_t>(0, length - shape.window) : 0;
      const int64_t n = length - first;
      const int32_t* table = tables + s * shape.table_width;
      const T* sequence_query = query + s * shape.heads * dim;
      for (int64_t i = 0; i < shape.heads * dim; ++i) q[i] = static_cast<float>(sequence_query[i]) * shape.scale;
      scores.resize(shape.heads * n);
      for_each_position(table, first, length, shape.block_size, [&](int64_t offset, int64_t cache_row) {
        score(path, q.data(), sequence_query, shape.scale, keys + cache_row * row, shape.heads, group, dim,
              scores.data() + offset, n);
      });
      for (int64_t h = 0; h < shape.heads; ++h) inverse[h] = 1.f / softmax_weights(scores.data() + h * n, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_position(table, first, length, shape.block_size, [&](int64_t offset, int64_t cache_row) {
        sum_values(path, scores.data() + offset, values + cache_row * row, shape.heads, group, dim, acc.data(), n);
      });
      T* sequence_out = out + s * shape.heads * dim;
      for (int64_t i = 0; i < shape.heads * dim; ++i) sequence_out[i] = static_cast<T>(acc[i] * inverse[i / dim]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, int64_t window, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [seqs, heads, dim], caches [blocks, size, kv_heads, dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and KV caches must share one dtype");
  const int64_t seqs = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "the key and value caches must have one shape");
  TORCH_CHECK(block_tables.size(0) == seqs && context_lens.size(0) == seqs, "one table and length per sequence");
  auto q = query.contiguous();
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lengths = context_lens.to(torch::kInt64).contiguous();
  const int64_t* length = lengths.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(length, length + seqs, [](int64_t n) { return n > 0; }), "every sequence needs context");
  TORCH_CHECK(std::all_of(length, length + seqs, [&](int64_t n) { return n <= tables.size(1) * block_size; }),
              "a context is longer than its block table");
  const int32_t* entries = tables.data_ptr<int32_t>();
  TORCH_CHECK(std::all_of(entries, entries + tables.numel(), [&](int32_t b) { return b >= 0 && b < key_cache.size(0); }),
              "a block table names a block outside the caches");
  auto out = torch::empty_like(q);
  const Shape shape{heads, kv_heads, dim, block_size, tables.size(1), window, static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_rows<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                          tables.data_ptr<int32_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), seqs,
                          shape);
  });
  return out;
}

// The step's new keys and values into their slots of the pool: key / value [1, kv_heads, tokens, dim]
// as the model makes them (any strides), caches [blocks, block_size, kv_heads, dim] of the same dtype,
// slots [tokens] (block * block_size + offset). What two index_copy_ calls on transposed views do, in
// one call: at batch 1 a layer's dispatch, not its copying, is what costs.
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slots) {
  TORCH_CHECK(key.dim() == 4 && key.size(0) == 1 && value.sizes() == key.sizes(), "key and value [1, kv_heads, tokens, dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes(),
              "the KV caches must be contiguous and of one shape");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "keys, values and caches must share one dtype");
  const int64_t kv_heads = key.size(1), tokens = key.size(2), dim = key.size(3);
  TORCH_CHECK(key_cache.size(2) == kv_heads && key_cache.size(3) == dim, "head shapes do not match");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.size(0) == tokens && slots.is_contiguous(),
              "one int64 slot per token");
  const int64_t capacity = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(slot, slot + tokens, [&](int64_t at) { return at >= 0 && at < capacity; }),
              "a slot lies outside the caches");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "key and value rows must be contiguous");
  const int64_t element = key.element_size(), row_bytes = dim * element;
  for (const auto& [source, cache] : {std::pair{key, key_cache}, std::pair{value, value_cache}}) {
    const auto* from = static_cast<const char*>(source.data_ptr());
    auto* to = static_cast<char*>(cache.data_ptr());
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(to + ((slot[t] * kv_heads + h) * dim) * element,
                    from + (h * source.stride(1) + t * source.stride(2)) * element, row_bytes);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention of one query token per sequence (CPU)");
  m.def("store_kv", &store_kv, "a step's new keys and values into their slots of the pool (CPU)");
}
