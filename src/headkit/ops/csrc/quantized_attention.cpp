// One query token's softmax attention over keys and values stored as KIVI codes (Liu et al. 2024, "KIVI",
// arXiv:2402.02750, Eq. Q), read on the codes: float32 on CPU, the decoding step of a quantized compressed cache.
//
// Storage (headkit.ops.quantized_cache.quantize_values): per token, groups of `group_size` channels, each with a
// scale s and zero point z, x = c·s + z; 8-bit codes one per byte, 4-bit codes two per byte (channel 2i in the
// low nibble, 2i + 1 in the high one). Per (batch, key/value head), with the G query rows of its group:
//   pass 1: each visible token's row is dequantized into 64-odd floats that stay in L1 (never written out), and
//           scored against every query row: s_n = scale · q · k_n; m = max_n s_n;
//   pass 2: p_n = e^{s_n − m}, l = Σ p_n, and Σ p_n v_n with each value row dequantized the same way.
// The result is this set's partial softmax (m, l, Σ p v), which the caller merges with its other sets under one
// normaliser (headkit.ops.quantized_attention). 4-bit rows are unpacked as two planes, the even channels and the
// odd ones, against the query split the same way, so that no nibble is interleaved back.
// With AVX-512 the passes are blocked: pass 1 takes 16 tokens at a time and sums each query row's 16 products in
// one transpose-and-add tree (not a horizontal sum of 8 dependent steps per token and row), pass 2 keeps a few query
// rows' weighted sums in registers while the value rows stream past (they were loaded and stored per token).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "exp_nonpositive.h"

namespace {

// Row `codes` of PLANES planes (1: 8-bit, channel i; 2: 4-bit, plane 0 the even channels, plane 1 the odd) of
// `width` channels dequantized into out[plane * width / PLANES + i], groups of `group_size` channels. WIDTH and
// GROUP: the widths known when compiled (the common head sizes), so that the loops unroll into whole vectors; 0
// where they are read at run time.
template <int PLANES, int WIDTH, int GROUP>
inline void dequantize_row(const uint8_t* __restrict codes, const float* __restrict scale,
                           const float* __restrict zero, float* __restrict out, int64_t width_, int64_t group_) {
  const int64_t width = WIDTH ? WIDTH : width_, group_size = GROUP ? GROUP : group_;
  const int64_t half = width / PLANES, per_group = group_size / PLANES, groups = width / group_size;
  for (int64_t j = 0; j < groups; ++j) {
    const float s = scale[j], z = zero[j];
    const uint8_t* __restrict c = codes + j * per_group;
    float* __restrict low = out + j * per_group;
    if constexpr (PLANES == 1) {
#pragma omp simd
      for (int64_t i = 0; i < per_group; ++i) low[i] = static_cast<float>(c[i]) * s + z;
    } else {
      float* __restrict high = out + half + j * per_group;
#pragma omp simd
      for (int64_t i = 0; i < per_group; ++i) {
        low[i] = static_cast<float>(c[i] & 0x0F) * s + z;
        high[i] = static_cast<float>(c[i] >> 4) * s + z;
      }
    }
  }
}

// A [rows, width] row-major query split into planes as dequantize_row lays a row out.
void split_planes(const float* q, float* out, int64_t rows, int64_t width, int64_t planes) {
  const int64_t half = width / planes;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < width; ++d) out[r * width + (d % planes) * half + d / planes] = q[r * width + d];
}

// Scores [rows, tokens] → the weights e^{s − m} in place (0 where not visible: e^{−inf} is clamped, so masked
// explicitly), m and l = Σ weights per row, a row at a time over contiguous tokens.
inline void softmax_weights(float* __restrict scores, float* __restrict m, float* __restrict l, int64_t rows,
                            int64_t tokens) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict sr = scores + r * tokens;
    float mr = kNegInf;
#pragma omp simd reduction(max : mr)
    for (int64_t n = 0; n < tokens; ++n) mr = std::max(mr, sr[n]);
    m[r] = mr;
    l[r] = 0.0f;
    if (mr == kNegInf) {
      std::fill(sr, sr + tokens, 0.0f);
      continue;
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t n = 0; n < tokens; ++n) {
      const float p = exp_nonpositive(sr[n] - mr);
      sr[n] = sr[n] == kNegInf ? 0.0f : p;
      total += sr[n];
    }
    l[r] = total;
  }
}

struct Set {
  const float* queries;  // [rows, dim], planes split
  const uint8_t *key_codes, *value_codes;
  const float *key_scale, *key_zero, *value_scale, *value_zero;
  const bool* visible;
  int64_t rows, tokens, dim, value_dim, group_size;
  float scale;
};

// One (batch, key/value head): m [rows], l [rows], acc [rows, value_dim] (planes laid out as a row), scores a
// [rows, tokens] scratch.
template <int PLANES, int WIDTH, int GROUP>
void attend_set(const Set& set, float* __restrict m, float* __restrict l, float* __restrict acc,
                float* __restrict scores, float* __restrict row) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t dim = WIDTH ? WIDTH : set.dim, value_dim = WIDTH ? WIDTH : set.value_dim;
  const int64_t group_size = GROUP ? GROUP : set.group_size, rows = set.rows, tokens = set.tokens;
  const int64_t key_width = dim / PLANES, value_width = value_dim / PLANES;
  const int64_t key_groups = dim / group_size, value_groups = value_dim / group_size;
  // Pass 1: scores [rows, tokens] (each row's contiguous, for the vector loops below), −inf where not visible.
  for (int64_t n = 0; n < tokens; ++n) {
    if (!set.visible[n]) {
      for (int64_t r = 0; r < rows; ++r) scores[r * tokens + n] = kNegInf;
      continue;
    }
    dequantize_row<PLANES, WIDTH, GROUP>(set.key_codes + n * key_width, set.key_scale + n * key_groups,
                                         set.key_zero + n * key_groups, row, dim, group_size);
    for (int64_t r = 0; r < rows; ++r) {
      const float* __restrict qr = set.queries + r * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qr[d] * row[d];
      scores[r * tokens + n] = dot * set.scale;
    }
  }
  softmax_weights(scores, m, l, rows, tokens);
  // Pass 2: the weighted values.
  for (int64_t n = 0; n < tokens; ++n) {
    if (!set.visible[n]) continue;
    dequantize_row<PLANES, WIDTH, GROUP>(set.value_codes + n * value_width, set.value_scale + n * value_groups,
                                         set.value_zero + n * value_groups, row, value_dim, group_size);
    for (int64_t r = 0; r < rows; ++r) {
      const float p = scores[r * tokens + n];
      float* __restrict ar = acc + r * value_dim;
#pragma omp simd
      for (int64_t d = 0; d < value_dim; ++d) ar[d] += p * row[d];
    }
  }
}

#if defined(__AVX512F__)
// The same set with AVX-512 (the build is -march=native): a row is 16-byte chunks of codes, each widened to 16
// lanes (4 bits: two vectors, the low nibbles — the even channels — and the high ones), dequantized in registers;
// the vectors sit in the plane layout of dequantize_row, so the split queries are read as they are. A group of
// scales spans whole chunks (GROUP / PLANES a multiple of 16 bytes), which attend_any checks.
template <int PLANES, int WIDTH, int GROUP>
struct Avx512Row {
  static constexpr int kChunks = WIDTH / PLANES / 16;
  static constexpr int kVectors = kChunks * PLANES;
  static constexpr int kChunksPerGroup = GROUP / PLANES / 16;
  static_assert(kChunks >= 1 && kChunksPerGroup >= 1, "a group spans whole 16-byte chunks");

  static inline void load(const uint8_t* codes, const float* scale, const float* zero, __m512 (&x)[kVectors]) {
    const __m512i nibble = _mm512_set1_epi32(0x0F);
#pragma GCC unroll 16
    for (int k = 0; k < kChunks; ++k) {
      const __m512 s = _mm512_set1_ps(scale[k / kChunksPerGroup]);
      const __m512 z = _mm512_set1_ps(zero[k / kChunksPerGroup]);
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * k)));
      if constexpr (PLANES == 2) {
        x[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, nibble)), s, z);
        x[kChunks + k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, z);
      } else {
        x[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), s, z);
      }
    }
  }
};

// The lane sums of 16 vectors as one vector, lane t the sum of v[t]: a transpose-and-add tree, 45 shuffles and
// adds for the 16 sums, where reducing each vector on its own takes about 8 dependent steps a vector.
inline __m512 lane_sums16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i]'s and v[2i+1]'s elements added two by two
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v[4i] … v[4i + 3]
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // the four 128-bit lanes added in pairs
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Query rows whose weighted values are accumulated in registers at once: V vectors a row, 16 registers in all.
template <int V>
constexpr int kRowsAtOnce = V >= 16 ? 1 : 16 / V;

template <int PLANES, int WIDTH, int GROUP>
void attend_set_avx512(const Set& set, float* __restrict m, float* __restrict l, float* __restrict acc,
                       float* __restrict scores, float* __restrict dots) {
  using Row = Avx512Row<PLANES, WIDTH, GROUP>;
  constexpr int V = Row::kVectors, R = kRowsAtOnce<V>;
  constexpr int kBytes = WIDTH / PLANES, kGroups = WIDTH / GROUP;
  const int64_t rows = set.rows, tokens = set.tokens;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 softmax_scale = _mm512_set1_ps(set.scale);
  __m512 x[V];
  // Pass 1, 16 tokens at a time: each visible key dequantized once into registers, its product with every query
  // row left as a vector in `dots` [rows, 16] (L1), then each row's 16 products summed by one tree.
  for (int64_t n0 = 0; n0 < tokens; n0 += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, tokens - n0));
    __mmask16 seen = 0;
    for (int t = 0; t < count; ++t) {
      const int64_t n = n0 + t;
      if (!set.visible[n]) continue;  // its lane is masked below: whatever `dots` holds there is never stored
      seen |= static_cast<__mmask16>(1u << t);
      Row::load(set.key_codes + n * kBytes, set.key_scale + n * kGroups, set.key_zero + n * kGroups, x);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = set.queries + r * WIDTH;
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qr), x[0]);
#pragma GCC unroll 16
        for (int v = 1; v < V; ++v) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * v), x[v], dot);
        _mm512_store_ps(dots + (r * 16 + t) * 16, dot);
      }
    }
    // lane t of a tree's sums reads vector t alone: a masked or missing token's lane is left out by the blend and
    // the masked store, so its vector is not zeroed
    const __mmask16 stored = static_cast<__mmask16>((1u << count) - 1u);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 sums = _mm512_mul_ps(lane_sums16(reinterpret_cast<const __m512*>(dots + r * 16 * 16)), softmax_scale);
      _mm512_mask_storeu_ps(scores + r * tokens + n0, stored, _mm512_mask_blend_ps(seen, neg_inf, sums));
    }
  }
  softmax_weights(scores, m, l, rows, tokens);
  // Pass 2: the weighted values, R query rows' sums held in registers while the value rows stream past.
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int64_t here = std::min<int64_t>(R, rows - r0);
    __m512 sum[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) sum[r][v] = _mm512_setzero_ps();
    for (int64_t n = 0; n < tokens; ++n) {
      if (!set.visible[n]) continue;
      Row::load(set.value_codes + n * kBytes, set.value_scale + n * kGroups, set.value_zero + n * kGroups, x);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        if (r >= here) break;
        const __m512 p = _mm512_set1_ps(scores[(r0 + r) * tokens + n]);
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) sum[r][v] = _mm512_fmadd_ps(p, x[v], sum[r][v]);
      }
    }
    for (int64_t r = 0; r < here; ++r)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (r0 + r) * WIDTH + 16 * v, sum[r][v]);
  }
}
#endif

template <int PLANES>
void attend_any(const Set& set, float* m, float* l, float* acc, float* scores, float* row, float* dots) {
  const bool same = set.dim == set.value_dim;
#if defined(__AVX512F__)
  // a group of scales spans whole 16-byte chunks: 16 · PLANES channels or more
  if (same && set.dim == 64 && set.group_size == 32)
    return attend_set_avx512<PLANES, 64, 32>(set, m, l, acc, scores, dots);
  if (same && set.dim == 64 && set.group_size == 64) return attend_set_avx512<PLANES, 64, 64>(set, m, l, acc, scores, dots);
  if (same && set.dim == 128 && set.group_size == 32)
    return attend_set_avx512<PLANES, 128, 32>(set, m, l, acc, scores, dots);
  if (same && set.dim == 128 && set.group_size == 64)
    return attend_set_avx512<PLANES, 128, 64>(set, m, l, acc, scores, dots);
  if (same && set.dim == 128 && set.group_size == 128)
    return attend_set_avx512<PLANES, 128, 128>(set, m, l, acc, scores, dots);
#endif
  if (same && set.dim == 64 && set.group_size == 32) return attend_set<PLANES, 64, 32>(set, m, l, acc, scores, row);
  if (same && set.dim == 64 && set.group_size == 64) return attend_set<PLANES, 64, 64>(set, m, l, acc, scores, row);
  if (same && set.dim == 128 && set.group_size == 32) return attend_set<PLANES, 128, 32>(set, m, l, acc, scores, row);
  if (same && set.dim == 128 && set.group_size == 64) return attend_set<PLANES, 128, 64>(set, m, l, acc, scores, row);
  if (same && set.dim == 128 && set.group_size == 128) return attend_set<PLANES, 128, 128>(set, m, l, acc, scores, row);
  attend_set<PLANES, 0, 0>(set, m, l, acc, scores, row);
}

std::vector<torch::Tensor> quantized_attention_partials(
    torch::Tensor queries, torch::Tensor key_codes, torch::Tensor key_scale, torch::Tensor key_zero,
    torch::Tensor value_codes, torch::Tensor value_scale, torch::Tensor value_zero, torch::Tensor visible,
    double scale, int64_t bits, int64_t group_size) {
  // The caller (headkit.ops.quantized_attention) checked shapes, dtypes and contiguity; these guard the memory reads.
  TORCH_CHECK(queries.dim() == 4 && queries.scalar_type() == torch::kFloat32 && queries.is_contiguous());
  TORCH_CHECK(bits == 4 || bits == 8);
  const int64_t batch = queries.size(0), heads = queries.size(1), rows = queries.size(2), dim = queries.size(3);
  const int64_t tokens = key_codes.size(2), planes = 8 / bits;
  const int64_t value_dim = value_codes.size(3) * planes;
  TORCH_CHECK(key_codes.size(3) * planes == dim && dim % group_size == 0 && value_dim % group_size == 0);
  TORCH_CHECK(group_size % planes == 0);
  for (const auto& t : {key_codes, value_codes}) TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.is_contiguous());
  for (const auto& t : {key_scale, key_zero, value_scale, value_zero})
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.size(2) == tokens);
  TORCH_CHECK(visible.scalar_type() == torch::kBool && visible.is_contiguous() && visible.size(2) == tokens);
  const int64_t visible_heads = visible.size(1);

  auto options = queries.options();
  // every entry is written below (softmax_weights sets m and l of each row, the numerators come from acc)
  auto maxima = torch::empty({batch, heads, rows}, options);
  auto sums = torch::empty({batch, heads, rows}, options);
  auto numerators = torch::empty({batch, heads, rows, value_dim}, options);

  const float* q_all = queries.data_ptr<float>();
  const uint8_t* kc_all = key_codes.data_ptr<uint8_t>();
  const uint8_t* vc_all = value_codes.data_ptr<uint8_t>();
  const float *ks_all = key_scale.data_ptr<float>(), *kz_all = key_zero.data_ptr<float>();
  const float *vs_all = value_scale.data_ptr<float>(), *vz_all = value_zero.data_ptr<float>();
  const bool* visible_all = visible.data_ptr<bool>();
  float* m_all = maxima.data_ptr<float>();
  float* l_all = sums.data_ptr<float>();
  float* n_all = numerators.data_ptr<float>();
  const int64_t key_width = dim / planes, value_width = value_dim / planes;
  const int64_t key_groups = dim / group_size, value_groups = value_dim / group_size;
  const float softmax_scale = static_cast<float>(scale);

  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(rows * dim), row(std::max(dim, value_dim)), scores(rows * tokens), acc(rows * value_dim);
#if defined(__AVX512F__)
    // each row's products with 16 keys, as 16 vectors: 64-byte aligned for whole-vector stores
    std::vector<float> dot_storage(rows * 16 * 16 + 16);
    float* dots = dot_storage.data() + (16 - (reinterpret_cast<uintptr_t>(dot_storage.data()) / sizeof(float)) % 16) % 16;
#else
    float* dots = nullptr;  // only the AVX-512 path scores keys in blocks
#endif
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      split_planes(q_all + bh * rows * dim, q.data(), rows, dim, planes);
      Set set{q.data(),
              kc_all + bh * tokens * key_width,
              vc_all + bh * tokens * value_width,
              ks_all + bh * tokens * key_groups,
              kz_all + bh * tokens * key_groups,
              vs_all + bh * tokens * value_groups,
              vz_all + bh * tokens * value_groups,
              visible_all + (b * visible_heads + (visible_heads == 1 ? 0 : h)) * tokens,
              rows, tokens, dim, value_dim, group_size, softmax_scale};
      std::fill(acc.begin(), acc.end(), 0.0f);
      float* m = m_all + bh * rows;
      float* l = l_all + bh * rows;
      if (planes == 2) {
        attend_any<2>(set, m, l, acc.data(), scores.data(), row.data(), dots);
      } else {
        attend_any<1>(set, m, l, acc.data(), scores.data(), row.data(), dots);
      }
      const int64_t half = value_dim / planes;
      float* out = n_all + bh * rows * value_dim;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < value_dim; ++d)
          out[r * value_dim + d] = acc[r * value_dim + (d % planes) * half + d / planes];
    }
  });
  return {maxima, sums, numerators};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_attention_partials", &quantized_attention_partials,
        "One query token per head group over KIVI codes: (max score, sum of weights, weighted values)");
}
