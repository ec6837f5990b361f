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
// Accumulation is in float32, every product-sum one fused multiply-add. Work is shared across the
// rows of a task only as data (keys converted once), never as sums. Lanes are 16 wide on every
// machine, taken as one AVX-512 register or two AVX2 ones: each operation is lane by lane, so every
// build gives the same bits (tests/test_kernel.py).
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
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int L = 16;   // slots per score block, lanes of the denominator
constexpr int HB = 8;   // query heads scored and accumulated together, at most
constexpr int64_t MAX_ROWS = 32;  // query rows per task
constexpr int64_t KB = 8;  // key blocks transposed at a time (64 KB in float32 at head dim 128)

// The machine's own vectors: VW lanes (16 with AVX-512, 8 with AVX2). The kernel's lanes are
// 16 wide whatever the machine; each op is lane-wise, so a 16-lane block taken as 16 / VW native
// vectors gives the same bits (wider generic vectors would live in memory: GCC has no register
// for them).
#if defined(__AVX512F__)
constexpr int VW = 16, REGS = 32;
#elif defined(__AVX2__)
constexpr int VW = 8, REGS = 16;
#else
constexpr int VW = 4, REGS = 16;
#endif
constexpr int NV = L / VW;  // native vectors to a 16-lane block
typedef float vn __attribute__((vector_size(VW * 4)));
typedef int32_t vni __attribute__((vector_size(VW * 4)));
typedef uint16_t vnh __attribute__((vector_size(VW * 2)));

inline vn load(const float* p) { vn x; std::memcpy(&x, p, sizeof x); return x; }
inline void store(float* p, vn x) { std::memcpy(p, &x, sizeof x); }
// x in every lane: one broadcast (0 + x, as this used to be written, costs an add on the way and
// turns -0 into +0, which no sum here can tell apart: each starts from +0).
inline vn splat(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vn>(_mm512_set1_ps(x));
#elif defined(__AVX2__)
  return reinterpret_cast<vn>(_mm256_set1_ps(x));
#else
  vn r;
  for (int l = 0; l < VW; ++l) r[l] = x;
  return r;
#endif
}

// VW consecutive elements as float32 (exact for every input type).
inline vn to_f32(const float* p) { return load(p); }
inline vn to_f32(const c10::BFloat16* p) {
  vnh h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vn>(__builtin_convertvector(h, vni) << 16);
}
inline vn to_f32(const c10::Half* p) {
  vn x;
  for (int l = 0; l < VW; ++l) x[l] = static_cast<float>(p[l]);
  return x;
}

// a * b + c rounded once, lane by lane: every product-sum below is written as one, so the
// arithmetic is the same whatever the compiler contracts (and equal to what GCC's default
// contraction made of the plain expressions this kernel used to write).
inline vn fma(vn a, vn b, vn c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vn>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
#elif defined(__AVX2__) && defined(__FMA__)
  return reinterpret_cast<vn>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
#else
  vn r;
  for (int l = 0; l < VW; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}

// e^x for x <= 0 (Cephes' expf polynomial), lane by lane: each lane's operations are those of
// the scalar form, in its order, so a lane's result does not depend on its neighbours.
inline vn exp_neg(vn x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vn y = fma(x, splat(1.44269504088896341f), splat(0.5f));
  vn n = __builtin_convertvector(__builtin_convertvector(y, vni), vn);  // toward zero; then floor:
  n = n + __builtin_convertvector(n > y, vn);                           // true is -1
  vn r = fma(-n, splat(0.693359375f), x);
  r = fma(n, splat(2.12194440e-4f), r);
  vn p = splat(1.9875691500e-4f);
  p = fma(p, r, splat(1.3981999507e-3f));
  p = fma(p, r, splat(8.3334519073e-3f));
  p = fma(p, r, splat(4.1665795894e-2f));
  p = fma(p, r, splat(1.6666665459e-1f));
  p = fma(p, r, splat(5.0000001201e-1f));
  const vn e = fma(p, r * r, r) + 1.0f;
  return e * reinterpret_cast<vn>((__builtin_convertvector(n, vni) + 127) << 23);
}

// Slots j0 .. j0+15 of a layer's keys (zeros past `count`), transposed to kT [D][16] in float32:
// a slot per lane, so a score is a lane's own sum over d. The transposition moves values, exactly.
template <typename T>
void transpose_keys(const T* k, int64_t kss, int64_t count, int64_t D, float* kT) {
  int64_t d0 = 0;
#ifdef __AVX512F__
  if constexpr (!std::is_same_v<T, c10::Half>) {
    for (; d0 + L <= D; d0 += L) {
      __m512 r[L];
      for (int j = 0; j < L; ++j) r[j] = j < count ? reinterpret_cast<__m512>(to_f32(k + j * kss + d0)) : _mm512_setzero_ps();
      __m512 t[L], u[L];
      for (int i = 0; i < L; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
      for (int i = 0; i < L; i += 4)
        for (int h = 0; h < 2; ++h) {
          const __m512d a = _mm512_castps_pd(t[i + h]), b = _mm512_castps_pd(t[i + h + 2]);
          u[i + h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), u[i + h + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
      // u[4m + o], rows 4m..4m+3: in its 128-bit part p, column 4p + c(o), c = (0, 2, 1, 3)[o]
      for (int i = 0; i < 8; ++i) {
        const int m = i / 4 * 8 + i % 4;  // rows 0-3 with 4-7 (i < 4), 8-11 with 12-15
        t[i] = _mm512_shuffle_f32x4(u[m], u[m + 4], 0x88), t[i + 8] = _mm512_shuffle_f32x4(u[m], u[m + 4], 0xdd);
      }
      for (int o = 0; o < 4; ++o)
        for (int h = 0; h < 2; ++h) {  // t[o + 8h]: rows 0-7, t[o + 8h + 4]: rows 8-15
          const int c = (o & 1) * 2 + (o >> 1) + 4 * h, a = o + 8 * h;
          _mm512_storeu_ps(kT + (d0 + c) * L, _mm512_shuffle_f32x4(t[a], t[a + 4], 0x88));
          _mm512_storeu_ps(kT + (d0 + c + 8) * L, _mm512_shuffle_f32x4(t[a], t[a + 4], 0xdd));
        }
    }
  }
#elif defined(__AVX2__)
  if constexpr (!std::is_same_v<T, c10::Half>) {
    for (; d0 + 8 <= D; d0 += 8)
      for (int half = 0; half < 2; ++half) {  // slots 8 half .. 8 half + 7: an 8 x 8 transposition
        __m256 r[8], t[8], u[8];
        for (int j = 0; j < 8; ++j) {
          const int64_t slot = 8 * half + j;
          r[j] = slot < count ? reinterpret_cast<__m256>(to_f32(k + slot * kss + d0)) : _mm256_setzero_ps();
        }
        for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        for (int i = 0; i < 8; i += 4)  // u[i + c]: column c (and c + 4) of rows i .. i+3
          for (int h = 0; h < 2; ++h)
            u[i + 2 * h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0x44), u[i + 2 * h + 1] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0xee);
        for (int c = 0; c < 4; ++c) {
          _mm256_storeu_ps(kT + (d0 + c) * L + 8 * half, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
          _mm256_storeu_ps(kT + (d0 + c + 4) * L + 8 * half, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
        }
      }
  }
#endif
  for (int64_t d = d0; d < D; ++d)
    for (int j = 0; j < L; ++j) kT[d * L + j] = j < count ? static_cast<float>(k[j * kss + d]) : 0.0f;
}

// Scores of a block of 16 slots for NH heads of one row: lane j sums q[d] * k_j[d], d ascending.
// qr: the row's queries [d][G heads] from its first head here; out: head i's 16 at out + i * hs.
template <int NH>
void score(const float* qr, int64_t G, const float* kT, int64_t D, float scale, float* out, int64_t hs) {
  vn a[NH][NV];
  for (int i = 0; i < NH; ++i)
    for (int c = 0; c < NV; ++c) a[i][c] = vn{};
  for (int64_t d = 0; d < D; ++d) {
    vn kd[NV];
    for (int c = 0; c < NV; ++c) kd[c] = load(kT + d * L + c * VW);
    for (int i = 0; i < NH; ++i) {
      const vn q = splat(qr[d * G + i]);
      for (int c = 0; c < NV; ++c) a[i][c] = fma(q, kd[c], a[i][c]);
    }
  }
  for (int i = 0; i < NH; ++i)
    for (int c = 0; c < NV; ++c) store(out + i * hs + c * VW, a[i][c] * scale);
}

// acc[i][d] += e_t * v_t[d] for the row's visible slots t0 <= t < t1 in ascending order, for NH
// heads and head dimensions d0 .. d0+nd (nd <= C x VW): e the weights by head and slot (slot j's of
// head i at e[i * es + j - e0]), jr the slots, acc head i's sums at acc + i * ash (float32 in memory
// between calls: storing and reloading a sum is exact, so a row's sum over all its slots is one fused
// multiply-add chain, t ascending, however its slots are cut into blocks).
template <typename T, int NH, int C>
void weigh(const float* e, int64_t es, int64_t e0, const T* v, int64_t kss, const int64_t* jr, int64_t t0, int64_t t1,
           int64_t d0, int64_t nd, float* acc, int64_t ash) {
  vn a[NH][C];
  for (int i = 0; i < NH; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = load(acc + i * ash + d0 + c * VW);
  if (nd == C * VW) {  // whole vectors (every head dimension of the models we run): no test in the loop
    for (int64_t t = t0; t < t1; ++t) {
      const T* vr = v + jr[t] * kss + d0;
      const float* et = e + (jr[t] - e0);
      vn vv[C];
      for (int c = 0; c < C; ++c) vv[c] = to_f32(vr + c * VW);
      for (int i = 0; i < NH; ++i) {
        const vn w = splat(et[i * es]);
        for (int c = 0; c < C; ++c) a[i][c] = fma(w, vv[c], a[i][c]);
      }
    }
  } else {
    for (int64_t t = t0; t < t1; ++t) {
      const T* vr = v + jr[t] * kss + d0;
      vn vv[C];
      for (int c = 0; c < C; ++c) {
        vv[c] = vn{};  // a head dimension that is not a multiple of the vector: padded with zeros
        for (int l = 0; l < VW && c * VW + l < nd; ++l) vv[c][l] = static_cast<float>(vr[c * VW + l]);
      }
      for (int i = 0; i < NH; ++i) {
        const vn w = splat(e[i * es + jr[t] - e0]);
        for (int c = 0; c < C; ++c) a[i][c] = fma(w, vv[c], a[i][c]);
      }
    }
  }
  for (int i = 0; i < NH; ++i)
    for (int c = 0; c < C; ++c) store(acc + i * ash + d0 + c * VW, a[i][c]);
}

// The head count of a block as a compile-time constant (its sums stay in registers).
template <template <int> class F, typename... A>
void by_heads(int64_t nh, A&&... a) {
  switch (nh) {
    case 1: return F<1>::run(a...);
    case 2: return F<2>::run(a...);
    case 3: return F<3>::run(a...);
    case 4: return F<4>::run(a...);
    case 5: return F<5>::run(a...);
    case 6: return F<6>::run(a...);
    case 7: return F<7>::run(a...);
    default: return F<8>::run(a...);
  }
}
template <int NH>
struct Score {
  template <typename... A> static void run(A... a) { score<NH>(a...); }
};
template <int NH>
struct Weigh {  // C vectors of dimensions at a time: as many (up to 4) as keep NH x C sums in registers
  static constexpr int C = (NH + 1) * 4 + 1 <= REGS ? 4 : (NH + 1) * 2 + 1 <= REGS ? 2 : 1, DC = C * VW;
  template <typename T>
  static void run(const float* e, int64_t es, int64_t e0, const T* v, int64_t kss, const int64_t* jr, int64_t t0,
                  int64_t t1, int64_t D, float* acc, int64_t ash) {
    for (int64_t d0 = 0; d0 < D; d0 += DC)
      weigh<T, NH, C>(e, es, e0, v, kss, jr, t0, t1, d0, std::min<int64_t>(DC, D - d0), acc, ash);
  }
};
// A row's sums are padded to whole vectors of the widest C (their padding lanes stay zero).
constexpr int64_t pad_dims(int64_t D) { return (D + 4 * VW - 1) / (4 * VW) * (4 * VW); }

template <typename T>
void run(const at::Tensor& q, const at::Tensor& cache, int64_t layer, const at::Tensor& lo, const at::Tensor& hi,
         const at::Tensor& tree, at::Tensor& out) {
  const int64_t H = q.size(1), W = q.size(2), D = q.size(3), KV = cache.size(2), S = cache.size(3), TT = tree.size(1);
  const int64_t G = H / KV;
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
  // Positions a block of step 3 takes: about 16 KB of values, which the rows then read from L1.
  const int64_t TB = std::clamp<int64_t>(16384 / (D * static_cast<int64_t>(sizeof(T))), L, 256);
  at::parallel_for(0, KV * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, sc, kT(KB * D * L), den, acc;
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
      // The rows' queries as float32, [row][d][head].
      qf.resize(R * D * G);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < G; ++i)
          for (int64_t d = 0; d < D; ++d)
            qf[(r * D + d) * G + i] = static_cast<float>(qp[(g * G + i) * qsh + (r0 + r) * qsw + d]);
      // 1. Scores of every block a row's span holds: 16 slots in the lanes, d summed in order. KB
      // blocks at a time: their keys transposed once, then every row takes them while they sit in
      // the second-level cache (each row's queries in the first, its scores written in order).
      sc.resize(R * G * NB * L);
      for (size_t m = 0; m < merged.size(); ++m) {
        for (int64_t b0 = merged[m].first; b0 <= merged[m].second; b0 += KB) {
          const int64_t b1 = std::min(b0 + KB - 1, merged[m].second);
          for (int64_t b = b0; b <= b1; ++b) {
            const int64_t j0 = b * L;
            transpose_keys(kp + g * ksh + j0 * kss, kss, std::min<int64_t>(L, S - j0), D, kT.data() + (b - b0) * D * L);
          }
          for (int64_t r = 0; r < R; ++r)  // the group's blocks this row sees
            for (int64_t b = std::max(b0, spans[r].first); b <= std::min(b1, spans[r].second); ++b) {
              const int64_t bi = offset[m] + b - merged[m].first;
              for (int64_t i0 = 0; i0 < G; i0 += HB)
                by_heads<Score>(std::min<int64_t>(HB, G - i0), qf.data() + r * D * G + i0, G,
                                static_cast<const float*>(kT.data() + (b - b0) * D * L), D, scale,
                                sc.data() + ((r * G + i0) * NB + bi) * L, NB * L);
            }
        }
      }
      // 2. Row by row and head by head, the softmax weights over the row's visible slots, each in
      // place of its slot's score: e_t = exp(score_t - max), t the slot's position among the row's
      // visible ones (its prefix's slots in order, contiguous, then its tree's), summed in lane
      // t mod 16 of the denominator.
      den.resize(R * G);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t* jr = js.data() + first[r];
        const int64_t n = first[r + 1] - first[r], base = spans[r].first * L;
        const int64_t prefix = std::max<int64_t>(0, hip[r0 + r] - lop[r0 + r]);  // its first slots, contiguous
        const int64_t whole = prefix / VW * VW;  // positions taken a vector at a time from contiguous slots
        for (int64_t i = 0; i < G; ++i) {
          float* s = sc.data() + ((r * G + i) * NB + at[r]) * L;  // s[j - base]: slot j's score
          float* sp = whole ? s + (jr[0] - base) : s;  // sp[t]: position t's, t < whole
          vn mv = splat(-INFINITY);
          for (int64_t t = 0; t < whole; t += VW) {
            const vn x = load(sp + t);
            mv = x > mv ? x : mv;
          }
          float mx = -INFINITY;
          for (int l = 0; l < VW; ++l) mx = mv[l] > mx ? mv[l] : mx;
          for (int64_t t = whole; t < n; ++t) mx = s[jr[t] - base] > mx ? s[jr[t] - base] : mx;
          const vn m = splat(mx);
          vn lanes[NV] = {};  // lane l of the 16: lanes[l / VW][l % VW]
          for (int64_t t = 0; t < whole; t += VW) {
            const vn x = exp_neg(load(sp + t) - m);
            store(sp + t, x);
            lanes[t / VW % NV] += x;
          }
          for (int64_t t = whole; t < n; t += VW) {  // the rest, lane by lane: past n, weights of 0
            float x[VW];
            for (int l = 0; l < VW; ++l) x[l] = t + l < n ? s[jr[t + l] - base] : 0.0f;
            store(x, exp_neg(load(x) - m));
            for (int l = 0; l < VW; ++l)
              if (t + l < n) s[jr[t + l] - base] = x[l];
              else x[l] = 0.0f;
            lanes[t / VW % NV] += load(x);
          }
          float h[L];
          for (int c = 0; c < NV; ++c) store(h + c * VW, lanes[c]);
          for (int w = L / 2; w >= 1; w /= 2)
            for (int l = 0; l < w; ++l) h[l] += h[l + w];
          den[r * G + i] = h[0];
        }
      }
      // 3. The weighted values, blocks of TB positions at a time across the task's rows: a block of
      // values is read from memory once and stays in the first-level cache while every row's sums
      // take it (rows share their prefix's slots position for position). Each row's sums still run
      // over its positions in ascending order (weigh), so the blocking changes no bit.
      const int64_t DP = pad_dims(D);
      acc.assign(R * G * DP, 0.0f);
      int64_t longest = 0;
      for (int64_t r = 0; r < R; ++r) longest = std::max(longest, first[r + 1] - first[r]);
      for (int64_t t0 = 0; t0 < longest; t0 += TB)
        for (int64_t r = 0; r < R; ++r) {
          const int64_t n = first[r + 1] - first[r];
          if (t0 >= n) continue;
          for (int64_t i0 = 0; i0 < G; i0 += HB)  // the weights where step 2 left them, in the scores' places
            by_heads<Weigh>(std::min<int64_t>(HB, G - i0),
                            static_cast<const float*>(sc.data() + ((r * G + i0) * NB + at[r]) * L), NB * L, spans[r].first * L, vp + g * ksh, kss,
                            static_cast<const int64_t*>(js.data() + first[r]), t0, std::min(n, t0 + TB), D,
                            acc.data() + (r * G + i0) * DP, DP);
        }
      for (int64_t r = 0; r < R; ++r) {
        const bool none = first[r + 1] == first[r];
        for (int64_t i = 0; i < G; ++i) {
          const float* a = acc.data() + (r * G + i) * DP;
          T* o = op + (g * G + i) * osh + (r0 + r) * osw;
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(none ? 0.0f : a[d] / den[r * G + i]);
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

// The operator is defined in Python (ygg_runtime/backend/schema.py, with its cache write declared), once for
// every device: this library adds its CPU kernel.
TORCH_LIBRARY_IMPL(ygg, CPU, m) { m.impl("attention", attention); }
