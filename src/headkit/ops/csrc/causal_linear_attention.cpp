// Causal linear attention (Katharopoulos et al. 2020, Eq. 9-11), forward and backward, float32 on CPU: the
// chunkwise form of headkit.ops.linear with each chunk's work kept in cache. Per (batch, key/value head) and chunk c
// of C tokens:
//   A = φ(Q_c) φ(K_c)ᵀ with its upper triangle zeroed, out_c = (φ(Q_c) S + A V_c) / (φ(Q_c) z + rowsum(A) + eps),
//   then S += φ(K_c)ᵀ V_c and z += colsum φ(K_c),
// where S = Σ φ(k_j) v_jᵀ and z = Σ φ(k_j) hold the earlier chunks. The four products go to the BLAS that torch
// links (sgemm_) on [C, D] tiles that stay in L1/L2; the PyTorch path runs the same products batched over every
// chunk, which streams each intermediate through memory.
//
// The backward recomputes each chunk's incoming state (S_c, z_c) by a forward sweep (kept, one [Dk, Dv] + [Dk] per
// chunk), then walks the chunks backwards carrying dS and dz, the gradients of the state that later chunks (and the
// final state) read. With n = φ(Q_c) S_c + A V_c, d = φ(Q_c) z_c + rowsum(A) + eps, o = n / d (per row):
//   dn = do / d, dd = −rowsum(do ⊙ o) / d, dA = (dn V_cᵀ + dd 1ᵀ) with its upper triangle zeroed,
//   dφ(Q_c) = dn S_cᵀ + dd z_cᵀ + dA φ(K_c),
//   dφ(K_c) = dAᵀ φ(Q_c) + V_c dSᵀ + 1 dzᵀ, dV_c = Aᵀ dn + φ(K_c) dS (query heads of a group summed),
//   then dS += φ(Q_c)ᵀ dn and dz += φ(Q_c)ᵀ dd over the group; after the first chunk, the initial state's.
// With elu, φ'(x) = 1 above zero and e^x = φ(x) below; a padded key (φ(k) = 0) gets no gradient.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp_nonpositive.h"

// The BLAS torch links (MKL on x86 builds): where the symbol is missing the extension does not load, and the op
// keeps its PyTorch path.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

// Row-major C[m, n] = op(A)[m, k] op(B)[k, n] + beta C through the column-major BLAS: Cᵀ = op(B)ᵀ op(A)ᵀ.
inline void gemm(bool trans_a, bool trans_b, int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  const float one = 1.0f;
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  sgemm_(&tb, &ta, &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

// φ(x) = elu(x) + 1 (Eq. 7): x + 1 above zero, e^x below.
inline void elu_plus_one(const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const float v = x[i];
    const float e = exp_nonpositive(std::min(v, 0.0f));
    y[i] = v > 0.0f ? v + 1.0f : e;
  }
}

inline void features(const float* x, float* y, int n, bool elu) {
  if (elu) {
    elu_plus_one(x, y, n);
  } else {
    std::copy(x, x + n, y);
  }
}

// φ(K_c) of c keys with the padded ones (keep[i] == 0) set to zero.
inline void key_features(const float* keys, const uint8_t* keep, float* phi_k, int c, int dk, bool elu) {
  features(keys, phi_k, c * dk, elu);
  if (keep != nullptr) {
    for (int i = 0; i < c; ++i) {
      if (!keep[i]) std::fill(phi_k + i * dk, phi_k + (i + 1) * dk, 0.0f);  // a zero feature: no key
    }
  }
}

// grad_x = grad_φ · φ'(x) in place, with φ = elu + 1: 1 above zero, e^x = φ(x) below.
inline void chain_elu(const float* x, const float* phi, float* grad, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) grad[i] *= x[i] > 0.0f ? 1.0f : phi[i];
}

// Threads for `items` independent tasks: torch's thread count, at most one per task.
inline int task_threads(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
}

}  // namespace

// q [B, H, T, Dk], k [B, Hkv, T, Dk], v [B, Hkv, T, Dv]: contiguous float32 (φ already applied unless elu); keep
// [B, T] uint8 (1 = real key) or empty; kv [B, Hkv, Dk, Dv] and k_sum [B, Hkv, Dk], contiguous float32, the state
// before the first token, updated in place to the state after the last. Returns out [B, H, T, Dv].
torch::Tensor causal_linear_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor keep,
                                      torch::Tensor kv, torch::Tensor k_sum, int64_t chunk, double eps, bool elu) {
  const int batch = q.size(0), heads = q.size(1), length = q.size(2), dk = q.size(3);
  // A chunk longer than the sequence is the sequence: the buffers are sized for what is used.
  const int kv_heads = k.size(1), dv = v.size(3), groups = heads / kv_heads;
  const int c_max = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(chunk, length)));
  auto out = torch::empty({batch, heads, length, dv}, q.options());
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  const uint8_t* keep_data = keep.numel() ? keep.data_ptr<uint8_t>() : nullptr;
  float* out_data = out.data_ptr<float>();
  float* kv_data = kv.data_ptr<float>();
  float* k_sum_data = k_sum.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);

  // One (batch, key/value head) per task, on as many threads as torch is set to use. Where torch ships libgomp.so.1
  // (its CPU wheels do), this region runs in torch's own OpenMP runtime, so the BLAS sees it and runs each small
  // product on the calling thread; a torch whose libgomp is renamed would add a second runtime (still correct).
  const int64_t items = static_cast<int64_t>(batch) * kv_heads;
  const int threads = task_threads(items);
#pragma omp parallel num_threads(threads)
  {
    // [φ(Q_c) | A] side by side and [S ; V_c] stacked: the output's two products are one, of depth Dk + C.
    const int width = dk + c_max;
    std::vector<float> phi_k(c_max * dk), query_scores(c_max * width), state_values(width * dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int b = item / kv_heads, h = item % kv_heads;
      float* state = kv_data + item * dk * dv;
      float* normaliser = k_sum_data + item * dk;
      const float* keys = k_data + item * static_cast<int64_t>(length) * dk;
      const float* values = v_data + item * static_cast<int64_t>(length) * dv;
      float* running_state = state_values.data();  // S, the first Dk rows of [S ; V_c]
      std::copy(state, state + dk * dv, running_state);
      for (int start = 0; start < length; start += c_max) {
        const int c = std::min(c_max, length - start);
        key_features(keys + static_cast<int64_t>(start) * dk,
                     keep_data == nullptr ? nullptr : keep_data + static_cast<int64_t>(b) * length + start,
                     phi_k.data(), c, dk, elu);
        float* chunk_values = running_state + dk * dv;
        std::copy(values + static_cast<int64_t>(start) * dv, values + static_cast<int64_t>(start + c) * dv,
                  chunk_values);
        for (int g = 0; g < groups; ++g) {  // the query heads that read this key/value head
          const int64_t query_head = static_cast<int64_t>(b) * heads + static_cast<int64_t>(h) * groups + g;
          float* o = out_data + (query_head * length + start) * dv;
          const float* queries = q_data + (query_head * length + start) * dk;
          for (int i = 0; i < c; ++i) features(queries + i * dk, query_scores.data() + i * width, dk, elu);
          float* scores = query_scores.data() + dk;
          gemm(false, true, c, c, dk, query_scores.data(), width, phi_k.data(), dk, 0.0f, scores, width);
          for (int i = 0; i < c; ++i) std::fill(scores + i * width + i + 1, scores + i * width + c, 0.0f);
          gemm(false, false, c, dv, dk + c, query_scores.data(), width, running_state, dv, 0.0f, o, dv);
          for (int i = 0; i < c; ++i) {
            const float* qi = query_scores.data() + i * width;
            const float* si = qi + dk;
            float denominator = epsilon;
#pragma omp simd reduction(+ : denominator)
            for (int d = 0; d < dk; ++d) denominator += qi[d] * normaliser[d];
#pragma omp simd reduction(+ : denominator)
            for (int j = 0; j <= i; ++j) denominator += si[j];
            const float inverse = 1.0f / denominator;
            for (int d = 0; d < dv; ++d) o[i * dv + d] *= inverse;
          }
        }
        gemm(true, false, dk, dv, c, phi_k.data(), dk, chunk_values, dv, 1.0f, running_state, dv);
        for (int i = 0; i < c; ++i) {
          for (int d = 0; d < dk; ++d) normaliser[d] += phi_k[i * dk + d];
        }
      }
      std::copy(running_state, running_state + dk * dv, state);
    }
  }
  return out;
}

// The gradients of causal_linear_attention. q, k, v, keep as given to it (pre-feature q and k when elu); kv [B, Hkv,
// Dk, Dv] and k_sum [B, Hkv, Dk] the initial state (as it was before the forward); out its output; grad_out
// [B, H, T, Dv] the output's gradient; grad_kv, grad_k_sum the final state's gradients, or empty for none. All
// contiguous float32. Returns {grad_q, grad_k, grad_v, grad_kv, grad_k_sum} (the last two: the initial state's).
std::vector<torch::Tensor> causal_linear_attention_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                            torch::Tensor keep, torch::Tensor kv,
                                                            torch::Tensor k_sum, torch::Tensor out,
                                                            torch::Tensor grad_out, torch::Tensor grad_kv,
                                                            torch::Tensor grad_k_sum, int64_t chunk, double eps,
                                                            bool elu) {
  const int batch = q.size(0), heads = q.size(1), length = q.size(2), dk = q.size(3);
  const int kv_heads = k.size(1), dv = v.size(3), groups = heads / kv_heads;
  const int c_max = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(chunk, length)));
  const int n_chunks = (length + c_max - 1) / c_max;
  // The final state's gradients seed dS and dz, which end as the initial state's.
  auto dq = torch::empty_like(q), dk_out = torch::empty_like(k), dv_out = torch::empty_like(v);
  auto d_state = grad_kv.numel() ? grad_kv.clone() : torch::zeros_like(kv);
  auto d_normaliser = grad_k_sum.numel() ? grad_k_sum.clone() : torch::zeros_like(k_sum);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  const uint8_t* keep_data = keep.numel() ? keep.data_ptr<uint8_t>() : nullptr;
  const float* kv_data = kv.data_ptr<float>();
  const float* k_sum_data = k_sum.data_ptr<float>();
  const float* out_data = out.data_ptr<float>();
  const float* grad_out_data = grad_out.data_ptr<float>();
  float* dq_data = dq.data_ptr<float>();
  float* dk_data = dk_out.data_ptr<float>();
  float* dv_data = dv_out.data_ptr<float>();
  float* d_state_data = d_state.data_ptr<float>();
  float* d_normaliser_data = d_normaliser.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);

  const int64_t items = static_cast<int64_t>(batch) * kv_heads;
  const int threads = task_threads(items);
#pragma omp parallel num_threads(threads)
  {
    const int64_t state_size = static_cast<int64_t>(dk) * dv;
    // [dn | dA] side by side and [S_cᵀ ; φ(K_c)] stacked: dφ(Q_c)'s two products are one, of depth Dv + C.
    const int width = dv + c_max;
    std::vector<float> phi_q(c_max * dk), scores(c_max * c_max), grads_side(c_max * width), state_keys(width * dk),
        d_denominator(c_max), states(static_cast<int64_t>(n_chunks) * (state_size + dk));
    float* const d_numerator = grads_side.data();      // dn [C, Dv], row stride width
    float* const d_scores = grads_side.data() + dv;    // dA [C, C], row stride width
    float* const phi_k = state_keys.data() + dv * dk;  // φ(K_c) [C, Dk], below S_cᵀ
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int b = item / kv_heads, h = item % kv_heads;
      const float* keys = k_data + item * static_cast<int64_t>(length) * dk;
      const float* values = v_data + item * static_cast<int64_t>(length) * dv;
      const uint8_t* keep_row = keep_data == nullptr ? nullptr : keep_data + static_cast<int64_t>(b) * length;
      float* saved_states = states.data();                                     // S_c: [n_chunks, Dk, Dv]
      float* saved_normalisers = states.data() + n_chunks * state_size;        // z_c: [n_chunks, Dk]
      float* d_s = d_state_data + item * state_size;                           // dS, [Dk, Dv]
      float* d_z = d_normaliser_data + item * dk;                              // dz, [Dk]

      // Forward sweep: the state each chunk reads.
      if (n_chunks > 0) {
        std::copy(kv_data + item * state_size, kv_data + (item + 1) * state_size, saved_states);
        std::copy(k_sum_data + item * dk, k_sum_data + (item + 1) * dk, saved_normalisers);
      }
      for (int ci = 0; ci + 1 < n_chunks; ++ci) {
        const int start = ci * c_max, c = std::min(c_max, length - start);
        key_features(keys + static_cast<int64_t>(start) * dk, keep_row == nullptr ? nullptr : keep_row + start,
                     phi_k, c, dk, elu);
        float* next_state = saved_states + (ci + 1) * state_size;
        float* next_normaliser = saved_normalisers + (ci + 1) * dk;
        std::copy(saved_states + ci * state_size, saved_states + (ci + 1) * state_size, next_state);
        std::copy(saved_normalisers + ci * dk, saved_normalisers + (ci + 1) * dk, next_normaliser);
        gemm(true, false, dk, dv, c, phi_k, dk, values + static_cast<int64_t>(start) * dv, dv, 1.0f,
             next_state, dv);
        for (int i = 0; i < c; ++i) {
          for (int d = 0; d < dk; ++d) next_normaliser[d] += phi_k[i * dk + d];
        }
      }

      // Reverse sweep.
      for (int ci = n_chunks - 1; ci >= 0; --ci) {
        const int start = ci * c_max, c = std::min(c_max, length - start);
        const float* chunk_keys = keys + static_cast<int64_t>(start) * dk;
        const float* chunk_values = values + static_cast<int64_t>(start) * dv;
        const float* state = saved_states + ci * state_size;
        const float* normaliser = saved_normalisers + ci * dk;
        float* d_values = dv_data + (item * length + start) * dv;
        float* d_keys = dk_data + (item * length + start) * dk;
        for (int d = 0; d < dk; ++d) {
          for (int e = 0; e < dv; ++e) state_keys[e * dk + d] = state[d * dv + e];  // S_cᵀ
        }
        key_features(chunk_keys, keep_row == nullptr ? nullptr : keep_row + start, phi_k, c, dk, elu);
        // What the later chunks read through the state: dφ(K_c) = V_c dSᵀ + 1 dzᵀ, dV_c = φ(K_c) dS.
        gemm(false, true, c, dk, dv, chunk_values, dv, d_s, dv, 0.0f, d_keys, dk);
        for (int i = 0; i < c; ++i) {
          for (int d = 0; d < dk; ++d) d_keys[i * dk + d] += d_z[d];
        }
        gemm(false, false, c, dv, dk, phi_k, dk, d_s, dv, 0.0f, d_values, dv);

        for (int g = 0; g < groups; ++g) {
          const int64_t query_head = static_cast<int64_t>(b) * heads + static_cast<int64_t>(h) * groups + g;
          const int64_t offset = query_head * length + start;
          const float* queries = q_data + offset * dk;
          const float* o = out_data + offset * dv;
          const float* d_o = grad_out_data + offset * dv;
          float* d_queries = dq_data + offset * dk;
          features(queries, phi_q.data(), c * dk, elu);
          gemm(false, true, c, c, dk, phi_q.data(), dk, phi_k, dk, 0.0f, scores.data(), c_max);
          for (int i = 0; i < c; ++i) {
            std::fill(scores.data() + i * c_max + i + 1, scores.data() + i * c_max + c, 0.0f);
          }
          // dn = do / d, dd = −rowsum(do ⊙ o) / d.
          for (int i = 0; i < c; ++i) {
            const float* qi = phi_q.data() + i * dk;
            const float* si = scores.data() + i * c_max;
            float denominator = epsilon;
#pragma omp simd reduction(+ : denominator)
            for (int d = 0; d < dk; ++d) denominator += qi[d] * normaliser[d];
#pragma omp simd reduction(+ : denominator)
            for (int j = 0; j <= i; ++j) denominator += si[j];
            const float inverse = 1.0f / denominator;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < dv; ++d) dot += d_o[i * dv + d] * o[i * dv + d];
            for (int d = 0; d < dv; ++d) d_numerator[i * width + d] = d_o[i * dv + d] * inverse;
            d_denominator[i] = -dot * inverse;
          }
          // dA = (dn V_cᵀ + dd 1ᵀ), lower triangle.
          gemm(false, true, c, c, dv, d_numerator, width, chunk_values, dv, 0.0f, d_scores, width);
          for (int i = 0; i < c; ++i) {
            float* row = d_scores + i * width;
            for (int j = 0; j <= i; ++j) row[j] += d_denominator[i];
            std::fill(row + i + 1, row + c, 0.0f);
          }
          // dφ(Q_c) = [dn | dA] [S_cᵀ ; φ(K_c)] + dd z_cᵀ, straight into dQ.
          gemm(false, false, c, dk, dv + c, grads_side.data(), width, state_keys.data(), dk, 0.0f, d_queries, dk);
          for (int i = 0; i < c; ++i) {
            for (int d = 0; d < dk; ++d) d_queries[i * dk + d] += d_denominator[i] * normaliser[d];
          }
          // dφ(K_c) += dAᵀ φ(Q_c), dV_c += Aᵀ dn.
          gemm(true, false, c, dk, c, d_scores, width, phi_q.data(), dk, 1.0f, d_keys, dk);
          gemm(true, false, c, dv, c, scores.data(), c_max, d_numerator, width, 1.0f, d_values, dv);
          // The earlier chunks' state is read by these queries: dS += φ(Q_c)ᵀ dn, dz += φ(Q_c)ᵀ dd.
          gemm(true, false, dk, dv, c, phi_q.data(), dk, d_numerator, width, 1.0f, d_s, dv);
          for (int i = 0; i < c; ++i) {
            for (int d = 0; d < dk; ++d) d_z[d] += phi_q[i * dk + d] * d_denominator[i];
          }
          if (elu) chain_elu(queries, phi_q.data(), d_queries, c * dk);
        }
        if (keep_row != nullptr) {
          for (int i = 0; i < c; ++i) {
            if (!keep_row[start + i]) std::fill(d_keys + i * dk, d_keys + (i + 1) * dk, 0.0f);
          }
        }
        if (elu) chain_elu(chunk_keys, phi_k, d_keys, c * dk);
      }
    }
  }
  return {dq, dk_out, dv_out, d_state, d_normaliser};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_linear_attention", &causal_linear_attention, "Causal linear attention forward (float32, CPU)");
  m.def("causal_linear_attention_backward", &causal_linear_attention_backward,
        "Causal linear attention backward (float32, CPU)");
}
