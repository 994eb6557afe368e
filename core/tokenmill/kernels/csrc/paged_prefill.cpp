// Flash attention for bfloat16 prompt chunks on CPU, read straight from the block pool: each chunk's
// queries attend causally to every position of their sequence (a cached prefix included), with no
// gather, no padding and no KV expansion for grouped-query heads. SDPA's CPU flash attention computes
// in float32 whatever its input; this computes the two products as bfloat16 pairs summed in float32
// (AVX512-BF16's vdpbf16ps: 32 products an instruction), the softmax in float32, online.
//
// query [tokens, heads, dim] (any strides with dim contiguous); key_cache / value_cache
// [blocks, block_size, kv_heads, dim]; block_tables [seqs, width] int32; per sequence, where its
// query tokens start in the step, how many there are and its context after the step (the queries
// are the context's last positions). Each query sees positions (p - window, p] of its sequence (all
// positions up to p when window is 0). out has query's shape.
//
// A task is one sequence's tile of queries for one KV head: up to 64 rows, each a (position, head of
// the KV head's group) pair, kept transposed so that every vector holds 16 rows. For each tile of 32
// keys: scores[key][rows] = the key's dimension pairs broadcast against the queries' (packed once per
// task); the online softmax runs across 16 rows a vector; the probabilities are paired by key and the
// output, transposed too, adds values[key pair][dim] broadcast against them. Tasks are taken largest
// first from a shared counter, so a causal prompt's long tiles do not all land on one thread.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TOKENMILL_PREFILL 1
#endif

bool bf16_prefill_built() {
#ifdef TOKENMILL_PREFILL
  return true;
#else
  return false;
#endif
}

#ifdef TOKENMILL_PREFILL
namespace {

constexpr int kKeys = 32;        // keys per tile
constexpr int kMaxVectors = 4;   // 16-row vectors per task: at most 64 rows
constexpr int kDimBlock = 4;     // output dimensions per register block

struct Shape {
  int64_t heads, kv_heads, dim, block_size, table_width, window;
  int64_t query_token_stride, query_head_stride, out_token_stride, out_head_stride;
  float scale;
};

struct Task {
  int64_t sequence, kv_head, first, count;  // query offsets [first, first + count) within the chunk
  int64_t cost;
};

// 2^x for finite x <= 0 (scores minus their maximum, in base 2): 2^f's Taylor polynomial of degree 5,
// f in [-0.5, 0.5] (relative error under 3e-6, far below bfloat16's 4e-3), times 2^n by vscalefps,
// which goes to 0 rather than wrapping for very negative n. Callers zero masked entries themselves.
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

// What one thread keeps between tasks.
struct Workspace {
  std::vector<uint32_t> queries;   // [pairs][vectors * 16]: each row's dimension pairs, transposed
  std::vector<float> scores;       // [kKeys][vectors * 16]
  std::vector<uint32_t> weights;   // [kKeys / 2][vectors * 16]: each row's probabilities, paired by key
  std::vector<uint32_t> values;    // [kKeys / 2][dim]: the tile's values, paired by key
  std::vector<float> out;          // [dim][vectors * 16]
  std::vector<at::BFloat16> zeros; // a row of zeros for the keys past a short tile's end
  explicit Workspace(int64_t dim)
      : queries(dim / 2 * kMaxVectors * 16), scores(kKeys * kMaxVectors * 16),
        weights(kKeys / 2 * kMaxVectors * 16), values(kKeys / 2 * dim), out(dim * kMaxVectors * 16), zeros(dim) {}
};

// scores[key][row] = q[row] . k[key] for the tile's keys, four keys at a time.
template <int V>
void score_tile(const uint32_t* queries, const uint32_t* const* keys, int64_t pairs, float* scores) {
  constexpr int width = V * 16;
  for (int j = 0; j < kKeys; j += 4) {
    __m512 acc[4][V];
    for (int k = 0; k < 4; ++k)
      for (int v = 0; v < V; ++v) acc[k][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512i q[V];
      for (int v = 0; v < V; ++v) q[v] = _mm512_loadu_si512(queries + p * width + v * 16);
      for (int k = 0; k < 4; ++k) {
        const __m512i key = _mm512_set1_epi32(static_cast<int>(keys[j + k][p]));
        for (int v = 0; v < V; ++v) acc[k][v] = dp(acc[k][v], key, q[v]);
      }
    }
    for (int k = 0; k < 4; ++k)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(scores + (j + k) * width + v * 16, acc[k][v]);
  }
}

// out[d][row] = out[d][row] * rescale[row] + the sum over keys of p[row][key] * value[key][d], keys taken
// in pairs.
template <int V>
void add_values(const uint32_t* weights, const uint32_t* values, const __m512* rescale, int64_t dim, float* out) {
  constexpr int width = V * 16;
  for (int64_t d = 0; d < dim; d += kDimBlock) {
    __m512 acc[kDimBlock][V];
    for (int k = 0; k < kDimBlock; ++k)
      for (int v = 0; v < V; ++v) acc[k][v] = _mm512_mul_ps(_mm512_loadu_ps(out + (d + k) * width + v * 16), rescale[v]);
    for (int q = 0; q < kKeys / 2; ++q) {
      __m512i w[V];
      for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(weights + q * width + v * 16);
      for (int k = 0; k < kDimBlock; ++k) {
        const __m512i value = _mm512_set1_epi32(static_cast<int>(values[q * dim + d + k]));
        for (int v = 0; v < V; ++v) acc[k][v] = dp(acc[k][v], value, w[v]);
      }
    }
    for (int k = 0; k < kDimBlock; ++k)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + (d + k) * width + v * 16, acc[k][v]);
  }
}

// values[q][d] = (v[2q][d], v[2q + 1][d]) as one 32-bit pair, 32 dimensions an iteration.
void pair_values(const at::BFloat16* const* rows, int64_t dim, uint32_t* values) {
  alignas(64) static const uint16_t low[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t high[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low_index = _mm512_load_si512(low), high_index = _mm512_load_si512(high);
  for (int q = 0; q < kKeys / 2; ++q) {
    for (int64_t d = 0; d < dim; d += 32) {
      const int64_t left = std::min<int64_t>(32, dim - d);  // 16 or 32: dim is a multiple of 16
      const __mmask32 mask = left == 32 ? 0xffffffffu : 0xffffu;
      const __m512i a = _mm512_maskz_loadu_epi16(mask, rows[2 * q] + d);
      const __m512i b = _mm512_maskz_loadu_epi16(mask, rows[2 * q + 1] + d);
      _mm512_storeu_si512(values + q * dim + d, _mm512_permutex2var_epi16(a, low_index, b));
      if (left == 32) _mm512_storeu_si512(values + q * dim + d + 16, _mm512_permutex2var_epi16(a, high_index, b));
    }
  }
}

template <int V>
void attend_task(const Task& task, const at::BFloat16* query, const at::BFloat16* keys, const at::BFloat16* values,
                 const int32_t* tables, const int64_t* starts, const int64_t* lengths, const int64_t* contexts,
                 at::BFloat16* out, const Shape& shape, Workspace& ws) {
  constexpr int width = V * 16;
  const int64_t dim = shape.dim, pairs = dim / 2, group = shape.heads / shape.kv_heads;
  const int64_t rows = task.count * group;
  const int64_t context = contexts[task.sequence], chunk = lengths[task.sequence];
  const int64_t first_position = context - chunk + task.first;  // the task's first query's position
  const int32_t* table = tables + task.sequence * shape.table_width;
  const int64_t kv_row = shape.kv_heads * dim;

  // Each row's query as dimension pairs, transposed; its position. Rows past the task's are copies of
  // its last row, so that every row sees at least one key; their output is dropped.
  alignas(64) int32_t position[width];
  for (int64_t r = 0; r < width; ++r) {
    const int64_t row = std::min(r, rows - 1), offset = row / group, head = task.kv_head * group + row % group;
    position[r] = static_cast<int32_t>(first_position + offset);
    const auto* q = reinterpret_cast<const uint32_t*>(query + (starts[task.sequence] + task.first + offset) *
                                                      shape.query_token_stride + head * shape.query_head_stride);
    for (int64_t p = 0; p < pairs; ++p) ws.queries[p * width + r] = q[p];
  }
  std::fill(ws.out.begin(), ws.out.begin() + dim * width, 0.f);
  __m512 top[V], total[V];
  __m512i seen_from[V], seen_to[V];
  for (int v = 0; v < V; ++v) {
    top[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    total[v] = _mm512_setzero_ps();
    const __m512i at = _mm512_loadu_si512(position + v * 16);
    seen_to[v] = at;
    seen_from[v] = shape.window > 0 ? _mm512_sub_epi32(at, _mm512_set1_epi32(static_cast<int>(shape.window - 1)))
                                    : _mm512_setzero_si512();
  }
  const int64_t last_position = first_position + task.count - 1;
  int64_t begin = shape.window > 0 ? std::max<int64_t>(0, first_position - shape.window + 1) : 0;
  begin -= begin % kKeys;
  const __m512 scale = _mm512_set1_ps(shape.scale * 1.44269504088896341f);  // scores in base 2
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) static const uint16_t interleave_index[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(interleave_index);
  const uint32_t* key_rows[kKeys];
  const at::BFloat16* value_rows[kKeys];
  for (int64_t k0 = begin; k0 <= last_position; k0 += kKeys) {
    for (int j = 0; j < kKeys; ++j) {
      const int64_t at = k0 + j;
      if (at <= last_position) {
        const int64_t cache_row = static_cast<int64_t>(table[at / shape.block_size]) * shape.block_size +
                                  at % shape.block_size;
        key_rows[j] = reinterpret_cast<const uint32_t*>(keys + cache_row * kv_row + task.kv_head * dim);
        value_rows[j] = values + cache_row * kv_row + task.kv_head * dim;
      } else {
        key_rows[j] = reinterpret_cast<const uint32_t*>(ws.zeros.data());
        value_rows[j] = ws.zeros.data();
      }
    }
    score_tile<V>(ws.queries.data(), key_rows, pairs, ws.scores.data());
    // The online softmax in base 2, 16 rows a vector: masked scores weigh exactly nothing.
    __m512 rescale[V];
    for (int v = 0; v < V; ++v) {
      __mmask16 visible[kKeys];
      __m512 tile_top = minus_infinity;
      for (int j = 0; j < kKeys; ++j) {
        const __m512i at = _mm512_set1_epi32(static_cast<int>(k0 + j));
        visible[j] = _mm512_cmple_epi32_mask(at, seen_to[v]) & _mm512_cmpge_epi32_mask(at, seen_from[v]);
        float* s = ws.scores.data() + j * width + v * 16;
        const __m512 scaled = _mm512_mask_mul_ps(minus_infinity, visible[j], _mm512_loadu_ps(s), scale);
        _mm512_storeu_ps(s, scaled);
        tile_top = _mm512_max_ps(tile_top, scaled);
      }
      const __m512 new_top = _mm512_max_ps(top[v], tile_top);
      // A row that has seen no key yet keeps a shift of 0: -inf minus -inf would be NaN.
      const __mmask16 empty = _mm512_cmpeq_ps_mask(new_top, minus_infinity);
      const __m512 shift = _mm512_mask_mov_ps(new_top, empty, _mm512_setzero_ps());
      rescale[v] = _mm512_maskz_mov_ps(~_mm512_cmpeq_ps_mask(top[v], minus_infinity), exp2_16(_mm512_sub_ps(top[v], shift)));
      top[v] = new_top;
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < kKeys; j += 2) {
        float* s = ws.scores.data() + j * width + v * 16;
        const __m512 a = _mm512_maskz_mov_ps(visible[j], exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s), shift)));
        const __m512 b = _mm512_maskz_mov_ps(visible[j + 1], exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + width), shift)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
        const __m512bh both = _mm512_cvtne2ps_pbh(b, a);  // a's 16 rows, then b's
        _mm512_storeu_si512(ws.weights.data() + j / 2 * width + v * 16,
                            _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i&>(both)));
      }
      total[v] = _mm512_fmadd_ps(total[v], rescale[v], sum);
    }
    pair_values(value_rows, dim, ws.values.data());
    add_values<V>(ws.weights.data(), ws.values.data(), rescale, dim, ws.out.data());
  }
  alignas(64) float inverse[width];
  for (int v = 0; v < V; ++v) _mm512_storeu_ps(inverse + v * 16, _mm512_div_ps(_mm512_set1_ps(1.f), total[v]));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t offset = row / group, head = task.kv_head * group + row % group;
    at::BFloat16* o = out + (starts[task.sequence] + task.first + offset) * shape.out_token_stride +
                      head * shape.out_head_stride;
    for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<at::BFloat16>(ws.out[d * width + row] * inverse[row]);
  }
}

template <int V>
void attend_all(const std::vector<Task>& tasks, const at::BFloat16* query, const at::BFloat16* keys,
                const at::BFloat16* values, const int32_t* tables, const int64_t* starts, const int64_t* lengths,
                const int64_t* contexts, at::BFloat16* out, const Shape& shape) {
  std::atomic<size_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Workspace ws(shape.dim);
    for (size_t t = next++; t < tasks.size(); t = next++)
      attend_task<V>(tasks[t], query, keys, values, tables, starts, lengths, contexts, out, shape, ws);
  });
}

}  // namespace
#endif

void paged_prefill(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor block_tables,
                   torch::Tensor query_starts, torch::Tensor query_lens, torch::Tensor context_lens, int64_t window,
                   double scale, torch::Tensor out) {
#ifndef TOKENMILL_PREFILL
  TORCH_CHECK(false, "this build of the prefill kernel has no AVX512-BF16");
#else
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [tokens, heads, dim], caches [blocks, size, kv_heads, dim]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "the prefill kernel takes bfloat16 queries and caches");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.sizes() == query.sizes(),
              "query and out need contiguous head rows and one shape");
  const int64_t heads = query.size(1), dim = query.size(2), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dim && heads % kv_heads == 0 && value_cache.sizes() == key_cache.sizes(),
              "head shapes do not match");
  TORCH_CHECK(dim % 16 == 0 && dim <= 256, "the prefill kernel takes head sizes that are multiples of 16, up to 256");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(group <= kMaxVectors * 16, "at most 64 query heads per KV head");
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto starts = query_starts.to(torch::kInt64).contiguous();
  auto lengths = query_lens.to(torch::kInt64).contiguous();
  auto contexts = context_lens.to(torch::kInt64).contiguous();
  const int64_t seqs = tables.size(0), block_size = key_cache.size(1);
  TORCH_CHECK(starts.numel() == seqs && lengths.numel() == seqs && contexts.numel() == seqs,
              "one table, start, length and context per sequence");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* context = contexts.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(length[s] > 0 && length[s] <= context[s], "every chunk needs queries within its context");
    TORCH_CHECK(start[s] >= 0 && start[s] + length[s] <= query.size(0), "a chunk's queries lie outside the step");
    TORCH_CHECK(context[s] <= tables.size(1) * block_size, "a context is longer than its block table");
  }
  const int32_t* entries = tables.data_ptr<int32_t>();
  TORCH_CHECK(std::all_of(entries, entries + tables.numel(), [&](int32_t b) { return b >= 0 && b < key_cache.size(0); }),
              "a block table names a block outside the caches");
  // Rows per task: as many positions as fit 64 rows, in as few 16-row vectors as they need.
  const int64_t positions = std::max<int64_t>(1, kMaxVectors * 16 / group);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t first = 0; first < length[s]; first += positions)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t count = std::min(positions, length[s] - first), last = context[s] - length[s] + first + count;
        const int64_t seen = window > 0 ? std::min(last, window + count) : last;
        tasks.push_back({s, h, first, count, seen * count});
      }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const Shape shape{heads, kv_heads, dim, block_size, tables.size(1), window, query.stride(0), query.stride(1),
                    out.stride(0), out.stride(1), static_cast<float>(scale)};
  const int vectors = static_cast<int>((positions * group + 15) / 16);
  const auto* q = query.data_ptr<at::BFloat16>();
  const auto* k = key_cache.data_ptr<at::BFloat16>();
  const auto* v = value_cache.data_ptr<at::BFloat16>();
  auto* o = out.data_ptr<at::BFloat16>();
  switch (vectors) {
    case 1: attend_all<1>(tasks, q, k, v, entries, start, length, context, o, shape); break;
    case 2: attend_all<2>(tasks, q, k, v, entries, start, length, context, o, shape); break;
    case 3: attend_all<3>(tasks, q, k, v, entries, start, length, context, o, shape); break;
    default: attend_all<4>(tasks, q, k, v, entries, start, length, context, o, shape); break;
  }
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", &paged_prefill, "flash attention of bfloat16 prompt chunks over their blocks (CPU)");
  m.def("bf16_prefill_built", &bf16_prefill_built, "whether this build has the AVX512-BF16 prefill kernel");
}
