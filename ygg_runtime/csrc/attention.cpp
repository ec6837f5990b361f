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
// so holes, other rows, the call's width and where the sequence sits in the cache never enter.
// Accumulation is in float32. Work is shared across the rows of a task only as data (keys
// converted once), never as sums.
//
// What a row sees is given compactly, not as a mask over the cache: its sequence's committed
// prefix, slots [lo, hi) (a sequence owns a contiguous region), and its tree window, slots
// hi + j where its row of `tree` [W, T] is set. So the cost of a call follows what its rows see,
// never the size of the cache, which `ygg serve` sizes by memory (tens of thousands of slots).
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
void run(const at::Tensor& q, const at::Tensor& cache, int64_t layer, const at::Tensor& lo, const at::Tensor& hi,
         const at::Tensor& tree, at::Tensor& out) {
  const int64_t H = q.size(1), W = q.size(2), D = q.size(3), KV = cache.size(2), S = cache.size(3), TT = tree.size(1);
  const int64_t G = H / KV, GP = (G + HB - 1) / HB * HB;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const T* qp = q.const_data_ptr<T>();
  const T* kp = cache.const_data_ptr<T>() + layer * cache.stride(0);
  const T* vp = kp + cache.stride(1);
  const int64_t* lop = lo.const_data_ptr<int64_t>();
  const int64_t* hip = hi.const_data_ptr<int64_t>();
  const bool* tp = tree.const_data_ptr<bool>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t qsh = q.stride(1), qsw = q.stride(2), ksh = cache.stride(2), kss = cache.stride(3);
  const int64_t osh = out.stride(1), osw = out.stride(2), tsw = tree.stride(0);
  // Tasks: (kv head, block of rows), enough of them to keep every thread busy. How rows are
  // grouped changes no result: each row's arithmetic is its own.
  const int64_t rows = std::clamp<int64_t>(W * KV / std::max<int64_t>(1, at::get_num_threads()), 1, MAX_ROWS);
  const int64_t blocks = (W + rows - 1) / rows;
  at::parallel_for(0, KV * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, sc, kT(D * L), e;
    std::vector<int64_t> js, first(MAX_ROWS + 1), at(MAX_ROWS);
    std::vector<std::pair<int64_t, int64_t>> spans, merged;  // 16-slot blocks [first, last]
    std::vector<int64_t> offset;  // each merged span's first block, in the task's block numbering
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task % KV, r0 = task / KV * rows, R = std::min<int64_t>(rows, W - r0);
      // Each row's visible slots in position order: [lo, hi), then hi + j where its tree row is set.
      js.clear();
      spans.clear();
      for (int64_t r = 0; r < R; ++r) {
        const int64_t l = lop[r0 + r], h = hip[r0 + r];
        const bool* tr = tp + (r0 + r) * tsw;
        first[r] = js.size();
        for (int64_t j = l; j < h; ++j) js.push_back(j);
        for (int64_t j = 0; j < TT; ++j)
          if (tr[j]) js.push_back(h + j);
        if (js.size() > static_cast<size_t>(first[r]))
          spans.emplace_back(std::min(l, h) / L, (js.back()) / L);
        else
          spans.emplace_back(0, -1);
      }
      first[R] = js.size();
      // The blocks some row of the task sees: each row's [first, last] block span, merged. A row's
      // span lies inside one merged span, so its blocks are consecutive in the task's numbering.
      std::vector<std::pair<int64_t, int64_t>> sorted;
      for (const auto& s : spans)
        if (s.second >= s.first) sorted.push_back(s);
      std::sort(sorted.begin(), sorted.end());
      merged.clear();
      for (const auto& s : sorted) {
        if (!merged.empty() && s.first <= merged.back().second + 1)
          merged.back().second = std::max(merged.back().second, s.second);
        else
          merged.push_back(s);
      }
      offset.assign(merged.size() + 1, 0);
      for (size_t m = 0; m < merged.size(); ++m) offset[m + 1] = offset[m] + merged[m].second - merged[m].first + 1;
      const int64_t NB = offset.back();
      for (int64_t r = 0; r < R; ++r) {  // where the row's first block sits in that numbering
        at[r] = 0;
        if (spans[r].second < spans[r].first) continue;
        for (size_t m = 0; m < merged.size(); ++m)
          if (spans[r].first >= merged[m].first && spans[r].first <= merged[m].second)
            at[r] = offset[m] + spans[r].first - merged[m].first;
      }
      // The rows' queries as float32, [row][d][head], heads padded to GP with zeros.
      qf.assign(R * D * GP, 0.0f);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < G; ++i)
          for (int64_t d = 0; d < D; ++d)
            qf[(r * D + d) * GP + i] = static_cast<float>(qp[(g * G + i) * qsh + (r0 + r) * qsw + d]);
      // 1. Scores of every block a row's span holds: 16 slots in the lanes, d summed in order.
      sc.resize(R * GP * NB * L);
      for (size_t m = 0; m < merged.size(); ++m) {
        for (int64_t b = merged[m].first; b <= merged[m].second; ++b) {
          const int64_t j0 = b * L, j1 = std::min<int64_t>(S, j0 + L), bi = offset[m] + b - merged[m].first;
          std::fill(kT.begin(), kT.end(), 0.0f);
          for (int64_t j = j0; j < j1; ++j) {
            const T* kr = kp + g * ksh + j * kss;
            for (int64_t d = 0; d < D; ++d) kT[d * L + (j - j0)] = static_cast<float>(kr[d]);
          }
          for (int64_t r = 0; r < R; ++r) {
            if (b < spans[r].first || b > spans[r].second) continue;  // not this row's
            for (int64_t i0 = 0; i0 < GP; i0 += HB) {
              vf a[HB] = {};
              const float* qr = qf.data() + r * D * GP + i0;
              for (int64_t d = 0; d < D; ++d) {
                const vf kd = load16(kT.data() + d * L);
                for (int i = 0; i < HB; ++i) a[i] += qr[d * GP + i] * kd;
              }
              for (int i = 0; i < HB; ++i) store16(sc.data() + ((r * GP + i0 + i) * NB + bi) * L, a[i] * scale);
            }
          }
        }
      }
      // 2 and 3, row by row: the softmax over the row's visible slots, then its weighted values.
      for (int64_t r = 0; r < R; ++r) {
        const int64_t* jr = js.data() + first[r];
        const int64_t n = first[r + 1] - first[r], np = (n + L - 1) / L * L, base = spans[r].first;
        e.assign(G * np, 0.0f);
        std::vector<float> den(G, 0.0f);
        for (int64_t i = 0; i < G; ++i) {
          const float* s = sc.data() + ((r * GP + i) * NB + at[r]) * L;
          float* ei = e.data() + i * np;
          for (int64_t t = 0; t < n; ++t) ei[t] = s[(jr[t] / L - base) * L + jr[t] % L];
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
              const T* vr = vp + g * ksh + jr[t] * kss + d0;
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

// Rows k, v [1, KV, W, D] to slots[w] of the cache's `layer` (cache [layers, 2, KV, slots, D]).
template <typename T>
void write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache, int64_t layer, const at::Tensor& slots) {
  const int64_t KV = cache.size(2), W = k.size(2), D = k.size(3);
  T* base = cache.mutable_data_ptr<T>() + layer * cache.stride(0);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int which = 0; which < 2; ++which) {
    const at::Tensor& x = which ? v : k;
    const T* xp = x.const_data_ptr<T>();
    T* dst = base + which * cache.stride(1);
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t w = 0; w < W; ++w)
        std::memcpy(dst + h * cache.stride(2) + sp[w] * cache.stride(3), xp + h * x.stride(1) + w * x.stride(2),
                    D * sizeof(T));
  }
}

// q [1, H, W, D]; k, v [1, KV, W, D]: the W new rows' keys and values, written to cache slots
// `slots` of layer `layer` of the cache [layers, 2, KV, slots, D] before anything is read. Row r
// then sees slots [lo[r], hi[r]) (its sequence's committed prefix) and hi[r] + j for every j
// with tree[r][j] (its tree window [W, T] bool). Returns [1, H, W, D] in q's dtype: softmax(q k^T /
// sqrt(D)) v over each row's visible slots.
//
// The cache is written in place though the schema does not say so: it is an input of the compiled
// graph, which no op but this one reads, and each layer's call depends on the last one's output,
// so no order of the graph's ops can read a slot before its write. (Declared as a mutation, export
// would copy the whole cache around every call: vLLM keeps its cache out of its graphs likewise.)
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
                     int64_t layer, const at::Tensor& slots, const at::Tensor& lo, const at::Tensor& hi,
                     const at::Tensor& tree) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1,
              "ygg::attention: q, k, v must be [1, heads, width, head_dim]");
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.size(2) == k.size(1) && cache.size(4) == q.size(3),
              "ygg::attention: cache must be [layers, 2, kv_heads, slots, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(3) == k.size(3) && q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0,
              "ygg::attention: k and v must match, and q's heads be a multiple of theirs");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
              q.scalar_type() == cache.scalar_type(), "ygg::attention: one dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && cache.stride(4) == 1,
              "ygg::attention: head_dim must be contiguous");
  TORCH_CHECK(0 <= layer && layer < cache.size(0), "ygg::attention: no such layer");
  const int64_t W = q.size(2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && lo.scalar_type() == at::kLong && hi.scalar_type() == at::kLong &&
              slots.numel() == W && lo.numel() == W && hi.numel() == W && slots.is_contiguous() && lo.is_contiguous()
              && hi.is_contiguous(), "ygg::attention: slots, lo and hi must be [width] int64");
  TORCH_CHECK(tree.scalar_type() == at::kBool && tree.dim() == 2 && tree.size(0) == W,
              "ygg::attention: tree must be [width, T] bool");
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu() && tree.device().is_cpu(), "ygg::attention: CPU tensors only");
  const int64_t S = cache.size(3), T = tree.size(1);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t* lp = lo.const_data_ptr<int64_t>();
  const int64_t* hp = hi.const_data_ptr<int64_t>();
  const at::Tensor t = tree.stride(1) == 1 ? tree : tree.contiguous();
  const bool* tp = t.const_data_ptr<bool>();
  for (int64_t w = 0; w < W; ++w) {
    int64_t last = hp[w] - 1;  // the row's last visible slot
    for (int64_t j = 0; j < T; ++j)
      if (tp[w * t.stride(0) + j]) last = hp[w] + j;
    TORCH_CHECK(0 <= sp[w] && sp[w] < S && 0 <= lp[w] && lp[w] <= hp[w] && last < S,
                "ygg::attention: a row's slots lie outside the cache");
  }
  at::Tensor out = at::empty_like(q);  // q's layout: what the traced graph expects (kernels._shape)
  switch (q.scalar_type()) {
    case at::kFloat: write<float>(k, v, cache, layer, slots); run<float>(q, cache, layer, lo, hi, t, out); break;
    case at::kBFloat16:
      write<c10::BFloat16>(k, v, cache, layer, slots);
      run<c10::BFloat16>(q, cache, layer, lo, hi, t, out);
      break;
    case at::kHalf: write<c10::Half>(k, v, cache, layer, slots); run<c10::Half>(q, cache, layer, lo, hi, t, out); break;
    default: TORCH_CHECK(false, "ygg::attention: float32, bfloat16 or float16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(ygg, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor cache, int layer, Tensor slots, Tensor lo, Tensor hi, "
        "Tensor tree) -> Tensor");
}
TORCH_LIBRARY_IMPL(ygg, CPU, m) { m.impl("attention", attention); }
