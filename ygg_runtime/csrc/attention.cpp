// ygg::attention — attention whose every output row is a function of that row's query and of the
// keys and values it may see, taken in cache-slot order, and of nothing else.
//
// Why (measured on the 2-core AVX-512 CPU, Qwen2.5-Coder-1.5B in bfloat16, see ygg_runtime/kernels.py):
// PyTorch's CPU attention (scaled_dot_product_attention) sums over cache *slots* with SIMD lanes and
// blocks, so a row's result depends on where its keys sit among masked slots and on how many query
// rows share the call. In a tree verify a node's ancestors sit at scattered slots (siblings between
// them); in plain decoding the same keys are contiguous. The sums then associate differently, the
// bfloat16 output differs in its last bit in ~2-4 % of calls, and greedy output flips at near-ties.
//
// Here every (query row, head) is computed on its own with one fixed order of arithmetic:
//   score_j = sum over d of q[d] * k_j[d], d ascending, one lane per slot (no horizontal sum);
//   m = max_j score_j;  e_j = exp(score_j - m) by one elementwise polynomial;
//   den = sum of e_j over the row's visible slots in ascending order, lane t mod 16 for the t-th
//         visible slot, then a fixed pairwise sum of the 16 lanes;
//   out[d] = (sum of e_j * v_j[d], visible slots ascending) / den.
// The t-th visible slot of a row is its t-th position (the prefix, then its ancestors by depth),
// so holes, other rows, the call's width and the span never enter. Accumulation is in float32.
// Work is shared across the rows of a task only as data (keys converted once), never as sums.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int L = 16;   // slots per score block, lanes of the denominator
constexpr int HB = 8;   // query heads scored and accumulated together
constexpr int DC = 64;  // head dimensions accumulated together in the value pass
constexpr int64_t MAX_ROWS = 32;  // query rows per task

typedef float vf __attribute__((vector_size(64)));  // 16 floats, whatever the target's vector width
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

inline vf load16(const float* p) { vf x; std::memcpy(&x, p, sizeof x); return x; }
inline void store16(float* p, vf x) { std::memcpy(p, &x, sizeof x); }

// 16 consecutive elements as float32 (exact for every input type).
inline vf to_f32(const float* p) { return load16(p); }
inline vf to_f32(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  vi w = __builtin_convertvector(h, vi) << 16;
  vf x;
  std::memcpy(&x, &w, sizeof x);
  return x;
}
inline vf to_f32(const c10::Half* p) {
  float t[L];
  for (int l = 0; l < L; ++l) t[l] = static_cast<float>(p[l]);
  return load16(t);
}

// e^x for x <= 0 (Cephes' expf polynomial); elementwise, so vectorising it changes no result.
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, at::Tensor& out) {
  const int64_t H = q.size(1), W = q.size(2), D = q.size(3), KV = k.size(1), S = mask.size(1);
  const int64_t G = H / KV, GP = (G + HB - 1) / HB * HB, NB = (S + L - 1) / L;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const bool* mp = mask.const_data_ptr<bool>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t qsh = q.stride(1), qsw = q.stride(2), ksh = k.stride(1), kss = k.stride(2);
  const int64_t vsh = v.stride(1), vss = v.stride(2), osh = out.stride(1), osw = out.stride(2), msw = mask.stride(0);
  // Tasks: (kv head, block of rows), enough of them to keep every thread busy. How rows are
  // grouped changes no result: each row's arithmetic is its own.
  const int64_t rows = std::clamp<int64_t>(W * KV / std::max<int64_t>(1, at::get_num_threads()), 1, MAX_ROWS);
  const int64_t blocks = (W + rows - 1) / rows;
  at::parallel_for(0, KV * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, sc, kT(D * L), e;
    std::vector<int64_t> js;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task % KV, r0 = task / KV * rows, R = std::min<int64_t>(rows, W - r0);
      // The rows' queries as float32, [row][d][head], heads padded to GP with zeros.
      qf.assign(R * D * GP, 0.0f);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < G; ++i)
          for (int64_t d = 0; d < D; ++d)
            qf[(r * D + d) * GP + i] = static_cast<float>(qp[(g * G + i) * qsh + (r0 + r) * qsw + d]);
      // 1. Scores of every 16-slot block some row sees: 16 slots in the lanes, d summed in order.
      sc.resize(R * GP * NB * L);
      for (int64_t b = 0; b < NB; ++b) {
        const int64_t j0 = b * L, j1 = std::min<int64_t>(S, j0 + L);
        bool any = false;
        for (int64_t r = 0; r < R && !any; ++r)
          for (int64_t j = j0; j < j1; ++j) any |= mp[(r0 + r) * msw + j];
        if (!any) continue;
        std::fill(kT.begin(), kT.end(), 0.0f);
        for (int64_t j = j0; j < j1; ++j) {
          const T* kr = kp + g * ksh + j * kss;
          for (int64_t d = 0; d < D; ++d) kT[d * L + (j - j0)] = static_cast<float>(kr[d]);
        }
        for (int64_t r = 0; r < R; ++r) {
          for (int64_t i0 = 0; i0 < GP; i0 += HB) {
            vf a[HB] = {};
            const float* qr = qf.data() + r * D * GP + i0;
            for (int64_t d = 0; d < D; ++d) {
              const vf kd = load16(kT.data() + d * L);
              for (int i = 0; i < HB; ++i) a[i] += qr[d * GP + i] * kd;
            }
            for (int i = 0; i < HB; ++i) store16(sc.data() + ((r * GP + i0 + i) * NB + b) * L, a[i] * scale);
          }
        }
      }
      // 2 and 3, row by row: the softmax over the row's visible slots, then its weighted values.
      for (int64_t r = 0; r < R; ++r) {
        const bool* mr = mp + (r0 + r) * msw;
        js.clear();
        for (int64_t j = 0; j < S; ++j)
          if (mr[j]) js.push_back(j);
        const int64_t n = js.size(), np = (n + L - 1) / L * L;
        e.assign(G * np, 0.0f);
        std::vector<float> den(G, 0.0f);
        for (int64_t i = 0; i < G; ++i) {
          const float* s = sc.data() + (r * GP + i) * NB * L;
          float* ei = e.data() + i * np;
          for (int64_t t = 0; t < n; ++t) ei[t] = s[js[t]];
          float m = -INFINITY;
          for (int64_t t = 0; t < n; ++t) m = std::max(m, ei[t]);
          for (int64_t t = 0; t < n; ++t) ei[t] = exp_neg(ei[t] - m);
          vf lanes = {};
          for (int64_t t = 0; t < np; t += L) lanes += load16(ei + t);
          float h[L];
          store16(h, lanes);
          for (int w = L / 2; w >= 1; w /= 2)
            for (int l = 0; l < w; ++l) h[l] += h[l + w];
          den[i] = h[0];
        }
        for (int64_t i0 = 0; i0 < G; i0 += HB) {
          const int64_t nh = std::min<int64_t>(HB, G - i0);
          for (int64_t d0 = 0; d0 < D; d0 += DC) {
            const int64_t nd = std::min<int64_t>(DC, D - d0);
            vf acc[HB][DC / L] = {};
            for (int64_t t = 0; t < n; ++t) {
              const T* vr = vp + g * vsh + js[t] * vss + d0;
              vf vv[DC / L];
              for (int c = 0; c < DC / L; ++c) {
                if ((c + 1) * L <= nd) {
                  vv[c] = to_f32(vr + c * L);
                } else {  // a head dimension that is not a multiple of 16: pad with zeros
                  float tmp[L] = {};
                  for (int l = 0; c * L + l < nd; ++l) tmp[l] = static_cast<float>(vr[c * L + l]);
                  vv[c] = load16(tmp);
                }
              }
              for (int64_t i = 0; i < nh; ++i) {
                const float w = e[(i0 + i) * np + t];
                for (int c = 0; c < DC / L; ++c) acc[i][c] += w * vv[c];
              }
            }
            for (int64_t i = 0; i < nh; ++i) {
              float tmp[DC];
              for (int c = 0; c < DC / L; ++c) store16(tmp + c * L, acc[i][c]);
              T* o = op + (g * G + i0 + i) * osh + (r0 + r) * osw + d0;
              for (int64_t d = 0; d < nd; ++d) o[d] = static_cast<T>(n ? tmp[d] / den[i0 + i] : 0.0f);
            }
          }
        }
      }
    }
  });
}

// q [1, H, W, D]; k, v [1, KV, >= S, D]; mask [W, S] bool (true: the row may attend to the slot).
// Returns [1, H, W, D] in q's dtype: softmax(q k^T / sqrt(D)) v over each row's visible slots.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1,
              "ygg::attention: q, k, v must be [1, heads, length, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "ygg::attention: k and v must match, and q's heads be a multiple of theirs");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "ygg::attention: one dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "ygg::attention: head_dim must be contiguous");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == q.size(2) && mask.size(1) <= k.size(2),
              "ygg::attention: mask must be [length, <= cache slots] bool");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu(),
              "ygg::attention: CPU tensors only");
  const at::Tensor m = mask.stride(1) == 1 ? mask : mask.contiguous();
  at::Tensor out = at::empty_like(q);  // q's layout: what the traced graph expects (kernels._shape)
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k, v, m, out); break;
    case at::kBFloat16: run<c10::BFloat16>(q, k, v, m, out); break;
    case at::kHalf: run<c10::Half>(q, k, v, m, out); break;
    default: TORCH_CHECK(false, "ygg::attention: float32, bfloat16 or float16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(ygg, m) { m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor"); }
TORCH_LIBRARY_IMPL(ygg, CPU, m) { m.impl("attention", attention); }
