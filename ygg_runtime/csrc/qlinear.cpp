// ygg::qlinear — y = x W^T + b with W held as integer codes (4, 6 or 8 bits) and per-group scales, for
// the 1..64 rows of a decode step or a tree verify, at nearly the cost of one row.
//
// Why (measured on the 2-core AVX-512 CPU, Qwen2.5-Coder-1.5B's linears, benchmarks/qlinear_kernels.py):
// a bf16 forward is bound by reading 3.1 GB of weights; torch's weight-only int4/int8 pack ops read
// 3-4x less at one row but dequantize the weights again for every 4 rows, so by 8-16 rows they cost
// more than bf16. Here each weight tile is read from memory once and unpacked once per block of 4
// rows, and every row multiplies it with int8 dot products (AVX-512 VNNI: 64 multiply-adds per
// instruction). One row is bound by memory (4-bit codes: ~4.5x faster than bf16); each further row
// costs the dot products' throughput (~2.6 ms per row of the 1.5B's 1.3 G multiply-adds on 2 cores),
// so a 16-row verify costs ~3x one row, still under bf16's.
//
// The weight format (`ygg_runtime.quant` documents and packs it) keeps a GGUF file's own
// quantization: w[n, k] = D[n, s] * sc[n, j] * c[n, k] + M[n, s] * mn[n, j], with codes c in
// [0, 2^bits), groups j of G = 16 or 32 columns of k with int8 multipliers (sc, mn), super-blocks s of
// S = G or 256 columns with float32 factors (D, M). Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and
// Q8_0 are all exactly this (a legacy block is a super-block of one group with sc = mn = 1).
//
// Activations are quantized per row and per 32 columns to int8 (a = da * q, |q| <= 127, as
// llama.cpp's q8_0), so the dot product of a group is an exact integer, and
//   y[m, n] = sum over groups j ascending of   fma(float(idot_j), (D_s * sc_j) * da_b, . )
//                                          then fma(M_s * mn_j, da_b * asum_j, . )        + b[n]
// (asum_j: the sum of the row's codes in group j). That order is the same for every row, every
// number of rows, every thread count and every instruction set below: a row's output is bitwise
// the same whatever the rows beside it (row invariance: the exactness of tree verification,
// `ygg_runtime.kernels`). The scalar reference `qlinear_reference` is the definition the fast paths
// are tested against, bit for bit.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define YGG_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define YGG_AVX2 1
#endif

namespace {

constexpr int64_t T = 16;  // output columns per tile (one 512-bit vector of floats)
constexpr int64_t B = 32;  // columns of k per activation block and per packed code block
constexpr int64_t R = 4;   // rows that share one unpacked weight block (8 spill registers: measured slower)

// One layer's weights as the kernel reads them (shapes checked in `check`).
struct Weights {
  const uint8_t* codes;  // [N/T][K/B][T*B*bits/8]: see `code_at`
  const float* D;        // [N/T][K/S][T]
  const float* M;        // [N/T][K/S][T]
  const int8_t* sc;      // [N/T][K/G][T]
  const int8_t* mn;      // [N/T][K/G][T]
  int64_t N, K, G, S, bits;
  int64_t block_bytes() const { return T * B * bits / 8; }
};

// The code of column n % T, k % B in a packed block. A block is [B/4 quads][T columns][4 k] bytes
// for 8-bit codes (a quad of 4 k is what one 32-bit VNNI lane sums); 4-bit codes keep quad 2i in
// the low and quad 2i+1 in the high nibbles of the same 64 bytes; 6-bit codes are 4-bit ones
// followed by their top two bits, quads 4i..4i+3 in bits 0-1, 2-3, 4-5, 6-7 of 64 bytes more.
inline int code_at(const uint8_t* block, int64_t bits, int64_t n, int64_t k) {
  const int64_t quad = k / 4, byte = n * 4 + k % 4;
  if (bits == 8) return block[quad * T * 4 + byte];
  const uint8_t b = block[(quad / 2) * T * 4 + byte];
  const int low = quad % 2 ? b >> 4 : b & 15;
  if (bits == 4) return low;
  const uint8_t h = block[T * B / 2 + (quad / 4) * T * 4 + byte];
  return low | (((h >> (2 * (quad % 4))) & 3) << 4);
}

// A row's activations as int8 codes, per block of 32: a[k] ~= da[k / 32] * q[k].
struct Activations {
  std::vector<int8_t> q;   // [rows][K]
  std::vector<float> da;   // [rows][K/B]
  std::vector<float> sq;   // [rows][K/G]: da of the group's block * the sum of its codes
};

template <typename X>
Activations quantize(const X* x, int64_t rows, int64_t K, int64_t G) {
  Activations a;
  a.q.resize(rows * K);
  a.da.resize(rows * (K / B));
  a.sq.resize(rows * (K / G));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < K / B; ++b) {
        float v[B];
        float amax = 0.0f;
        for (int64_t i = 0; i < B; ++i) {
          v[i] = static_cast<float>(x[m * K + b * B + i]);
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t* q = a.q.data() + m * K + b * B;
        for (int64_t i = 0; i < B; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(v[i] * id), -127.0f, 127.0f));
        a.da[m * (K / B) + b] = d;
        for (int64_t g0 = 0; g0 < B; g0 += G) {
          int32_t s = 0;
          for (int64_t i = g0; i < g0 + G; ++i) s += q[i];
          a.sq[m * (K / G) + (b * B + g0) / G] = d * static_cast<float>(s);
        }
      }
    }
  });
  return a;
}

// Where results go: row m's columns [c0, c0 + 16) of float32 sums, plus the bias, rounded once to
// the output's dtype; columns past n (the last tile's padding) are dropped.
template <typename O>
struct Out {
  O* data;
  int64_t n;
  const float* bias;  // n values (zeros without a bias)
  void emit(int64_t m, int64_t c0, const float* acc) const {
    const int64_t cols = std::min<int64_t>(T, n - c0);
    for (int64_t c = 0; c < cols; ++c) data[m * n + c0 + c] = static_cast<O>(acc[c] + bias[c0 + c]);
  }
};

// The definition: each output on its own, in the order the header states.
template <typename O>
void reference(const Weights& w, const Activations& a, int64_t rows, const Out<O>& out) {
  const int64_t KB = w.K / B, KG = w.K / w.G, KS = w.K / w.S;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t t = 0; t < w.N / T; ++t) {
      float acc[T];
      for (int64_t c = 0; c < T; ++c) {
        acc[c] = 0.0f;
        for (int64_t j = 0; j < KG; ++j) {
          const int64_t k0 = j * w.G, b = k0 / B, s = k0 / w.S;
          const uint8_t* block = w.codes + (t * KB + b) * w.block_bytes();
          int32_t dot = 0;
          for (int64_t k = k0; k < k0 + w.G; ++k) dot += code_at(block, w.bits, c, k % B) * a.q[m * w.K + k];
          const int64_t fs = (t * KS + s) * T + c, fj = (t * KG + j) * T + c;
          const float scale = w.D[fs] * static_cast<float>(w.sc[fj]);
          const float offset = w.M[fs] * static_cast<float>(w.mn[fj]);
          acc[c] = std::fma(static_cast<float>(dot), scale * a.da[m * KB + b], acc[c]);
          acc[c] = std::fma(offset, a.sq[m * KG + j], acc[c]);
        }
      }
      out.emit(m, t * T, acc);
    }
}

// Tiles [t0, t1) for every row: the block's codes unpacked once per R rows; plain C++ (what any
// CPU runs; the compiler vectorises the integer dot products).
template <typename O>
void tiles_portable(const Weights& w, const Activations& a, int64_t rows, const Out<O>& out, int64_t t0, int64_t t1) {
  const int64_t KB = w.K / B, KG = w.K / w.G, KS = w.K / w.S, GB = B / w.G;
  uint8_t u[T][B];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t nr = std::min(R, rows - r0);
      float acc[R][T] = {};
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* block = w.codes + (t * KB + b) * w.block_bytes();
        for (int64_t c = 0; c < T; ++c)
          for (int64_t k = 0; k < B; ++k) u[c][k] = static_cast<uint8_t>(code_at(block, w.bits, c, k));
        for (int64_t gi = 0; gi < GB; ++gi) {
          const int64_t j = b * GB + gi, s = b * B / w.S;
          float scale[T], offset[T];
          for (int64_t c = 0; c < T; ++c) {
            scale[c] = w.D[(t * KS + s) * T + c] * static_cast<float>(w.sc[(t * KG + j) * T + c]);
            offset[c] = w.M[(t * KS + s) * T + c] * static_cast<float>(w.mn[(t * KG + j) * T + c]);
          }
          for (int64_t r = 0; r < nr; ++r) {
            const int8_t* q = a.q.data() + (r0 + r) * w.K + b * B + gi * w.G;
            const float da = a.da[(r0 + r) * KB + b], sq = a.sq[(r0 + r) * KG + j];
            for (int64_t c = 0; c < T; ++c) {
              int32_t dot = 0;
              for (int64_t k = 0; k < w.G; ++k) dot += u[c][gi * w.G + k] * q[k];
              acc[r][c] = std::fma(static_cast<float>(dot), scale[c] * da, acc[r][c]);
              acc[r][c] = std::fma(offset[c], sq, acc[r][c]);
            }
          }
        }
      }
      for (int64_t r = 0; r < nr; ++r) out.emit(r0 + r, t * T, acc[r]);
    }
}

#ifdef YGG_VNNI
// The same arithmetic with AVX-512 VNNI: T columns in the lanes of one vector, each lane summing a
// quad of k per instruction (vpdpbusd: unsigned codes times signed activations, exact in int32).
// NR rows at a time; NR, the group G and the code width are compile-time constants, so the loops
// unroll and the rows' accumulators and the block's codes stay in registers.
template <int NR, int G, int BITS>
struct VNNI {
  template <typename O>
  static void run(const Weights& w, const Activations& a, int64_t r0, const Out<O>& out, int64_t t) {
    constexpr int GB = B / G, QG = G / 4;
    const int64_t KB = w.K / B, KG = w.K / G, KS = w.K / w.S;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    const int sshift = w.S == 256 ? 3 : 0;  // super-block of a block: b >> sshift (no division in the loop)
    const int8_t* q0 = a.q.data() + r0 * w.K;
    const float* da0 = a.da.data() + r0 * KB;
    const float* sq0 = a.sq.data() + r0 * KG;
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* block = w.codes + (t * KB + b) * (T * B * BITS / 8);
      __m512i u[B / 4];  // quad i of the block: T columns x 4 k
      if constexpr (BITS == 8) {
        for (int i = 0; i < B / 4; ++i) u[i] = _mm512_loadu_si512(block + i * 64);
      } else {
        for (int i = 0; i < B / 8; ++i) {
          const __m512i p = _mm512_loadu_si512(block + i * 64);
          u[2 * i] = _mm512_and_si512(p, low);
          u[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
        }
        if constexpr (BITS == 6) {
          const __m512i two = _mm512_set1_epi8(3);
          for (int i = 0; i < B / 16; ++i) {
            const __m512i h = _mm512_loadu_si512(block + T * B / 2 + i * 64);
            for (int j = 0; j < 4; ++j) {
              const __m512i top = _mm512_and_si512(_mm512_srli_epi16(h, 2 * j), two);
              u[4 * i + j] = _mm512_or_si512(u[4 * i + j], _mm512_slli_epi16(top, 4));
            }
          }
        }
      }
      const int64_t s = b >> sshift;
      const __m512 D = _mm512_loadu_ps(w.D + (t * KS + s) * T), M = _mm512_loadu_ps(w.M + (t * KS + s) * T);
      for (int gi = 0; gi < GB; ++gi) {
        const int64_t j = b * GB + gi;
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + (t * KG + j) * T));
        const __m128i mn8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mn + (t * KG + j) * T));
        const __m512 scale = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)));
        const __m512 offset = _mm512_mul_ps(M, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(mn8)));
        __m512i dot[NR];
        for (int r = 0; r < NR; ++r) dot[r] = _mm512_setzero_si512();
        for (int i = 0; i < QG; ++i)  // rows innermost: NR independent chains of dot products
          for (int r = 0; r < NR; ++r) {
            int32_t quad;
            std::memcpy(&quad, q0 + r * w.K + b * B + gi * G + 4 * i, 4);
            dot[r] = _mm512_dpbusd_epi32(dot[r], u[gi * QG + i], _mm512_set1_epi32(quad));
          }
        for (int r = 0; r < NR; ++r) {
          const __m512 da = _mm512_set1_ps(da0[r * KB + b]), sq = _mm512_set1_ps(sq0[r * KG + j]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(scale, da), acc[r]);
          acc[r] = _mm512_fmadd_ps(offset, sq, acc[r]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      alignas(64) float tmp[T];
      _mm512_store_ps(tmp, acc[r]);
      out.emit(r0 + r, t * T, tmp);
    }
  }
};

#endif

#ifdef YGG_AVX2
// The same arithmetic with AVX2 (CPUs without AVX-512 VNNI): the tile's 16 columns as two halves of 8
// int32 lanes, each lane's 4 products summed exactly by maddubs (unsigned codes x signed bytes into
// int16 pairs: codes below 64 times |q| <= 127 cannot saturate; 8-bit codes go in as two nibbles)
// and madd (pairs into int32).
template <int BITS>
inline __m256i dot_quad(__m256i dot, __m256i codes, __m256i q4) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 8) {
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(codes, low), q4), ones);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(codes, 4), low), q4), ones);
    return _mm256_add_epi32(dot, _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4)));
  } else {
    return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q4), ones));
  }
}

template <int NR, int G, int BITS>
struct AVX2 {
  template <typename O>
  static void run(const Weights& w, const Activations& a, int64_t r0, const Out<O>& out, int64_t t) {
    constexpr int GB = B / G, QG = G / 4, H = T / 2;
    const int64_t KB = w.K / B, KG = w.K / G, KS = w.K / w.S;
    const int sshift = w.S == 256 ? 3 : 0;
    const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    const int8_t* q0 = a.q.data() + r0 * w.K;
    alignas(32) float res[NR][T];
    for (int half = 0; half < 2; ++half) {
      __m256 acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* block = w.codes + (t * KB + b) * (T * B * BITS / 8) + half * 32;
        __m256i u[B / 4];
        if constexpr (BITS == 8) {
          for (int i = 0; i < B / 4; ++i) u[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + i * 64));
        } else {
          for (int i = 0; i < B / 8; ++i) {
            const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + i * 64));
            u[2 * i] = _mm256_and_si256(p, low);
            u[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
          }
          if constexpr (BITS == 6) {
            for (int i = 0; i < B / 16; ++i) {
              const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + T * B / 2 + i * 64));
              for (int j = 0; j < 4; ++j)
                u[4 * i + j] = _mm256_or_si256(u[4 * i + j],
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j), two), 4));
            }
          }
        }
        const int64_t s = b >> sshift;
        const __m256 D = _mm256_loadu_ps(w.D + (t * KS + s) * T + half * H), M = _mm256_loadu_ps(w.M + (t * KS + s) * T + half * H);
        for (int gi = 0; gi < GB; ++gi) {
          const int64_t j = b * GB + gi;
          const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + (t * KG + j) * T + half * H));
          const __m128i mn8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + (t * KG + j) * T + half * H));
          const __m256 scale = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
          const __m256 offset = _mm256_mul_ps(M, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mn8)));
          for (int r = 0; r < NR; ++r) {
            __m256i dot = _mm256_setzero_si256();
            for (int i = 0; i < QG; ++i) {
              int32_t quad;
              std::memcpy(&quad, q0 + r * w.K + b * B + gi * G + 4 * i, 4);
              dot = dot_quad<BITS>(dot, u[gi * QG + i], _mm256_set1_epi32(quad));
            }
            const __m256 da = _mm256_set1_ps(a.da[(r0 + r) * KB + b]), sq = _mm256_set1_ps(a.sq[(r0 + r) * KG + j]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, da), acc[r]);
            acc[r] = _mm256_fmadd_ps(offset, sq, acc[r]);
          }
        }
      }
      for (int r = 0; r < NR; ++r) _mm256_store_ps(res[r] + half * H, acc[r]);
    }
    for (int r = 0; r < NR; ++r) out.emit(r0 + r, t * T, res[r]);
  }
};

#endif

// Tiles [t0, t1) for every row through a SIMD path `Rows<rows, group, code width>::run`, in blocks
// of R rows, with the format's constants made compile-time ones.
template <template <int, int, int> class Rows, int G, int BITS, typename O>
void tiles_as(const Weights& w, const Activations& a, int64_t rows, const Out<O>& out, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      switch (std::min(R, rows - r0)) {
        case 1: Rows<1, G, BITS>::run(w, a, r0, out, t); break;
        case 2: Rows<2, G, BITS>::run(w, a, r0, out, t); break;
        case 3: Rows<3, G, BITS>::run(w, a, r0, out, t); break;
        default: Rows<R, G, BITS>::run(w, a, r0, out, t); break;
      }
    }
}

template <template <int, int, int> class Rows, typename O>
[[maybe_unused]] void tiles_simd(const Weights& w, const Activations& a, int64_t rows, const Out<O>& out, int64_t t0, int64_t t1) {
  if (w.G == 32) {
    if (w.bits == 4) return tiles_as<Rows, 32, 4>(w, a, rows, out, t0, t1);
    if (w.bits == 6) return tiles_as<Rows, 32, 6>(w, a, rows, out, t0, t1);
    return tiles_as<Rows, 32, 8>(w, a, rows, out, t0, t1);
  }
  if (w.bits == 4) return tiles_as<Rows, 16, 4>(w, a, rows, out, t0, t1);
  if (w.bits == 6) return tiles_as<Rows, 16, 6>(w, a, rows, out, t0, t1);
  return tiles_as<Rows, 16, 8>(w, a, rows, out, t0, t1);
}

// Which implementation runs: the fastest this build has ("avx512-vnni", "avx2"), unless
// YGG_QLINEAR=portable asks for the plain C++ one (tests compare them; benchmarks time them).
const char* path() {
  static const bool portable = [] {
    const char* e = std::getenv("YGG_QLINEAR");
    return e != nullptr && std::strcmp(e, "portable") == 0;
  }();
#if defined(YGG_VNNI)
  return portable ? "portable" : "avx512-vnni";
#elif defined(YGG_AVX2)
  return portable ? "portable" : "avx2";
#else
  return "portable";
#endif
}

Weights check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& D, const at::Tensor& M,
              const at::Tensor& sc, const at::Tensor& mn) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "ygg::qlinear: CPU tensors only");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous(),
              "ygg::qlinear: codes must be contiguous uint8 [N/16, K/32, bytes]");
  TORCH_CHECK(D.scalar_type() == at::kFloat && M.scalar_type() == at::kFloat && D.dim() == 3 && D.sizes() == M.sizes() &&
              D.is_contiguous() && M.is_contiguous(), "ygg::qlinear: D and M must be contiguous float32 [N/16, K/S, 16]");
  TORCH_CHECK(sc.scalar_type() == at::kChar && mn.scalar_type() == at::kChar && sc.dim() == 3 && sc.is_contiguous() &&
              mn.is_contiguous() && (sc.sizes() == mn.sizes() || mn.numel() == 0),
              "ygg::qlinear: sc and mn must be contiguous int8 [N/16, K/G, 16] (mn empty: the same as sc)");
  Weights w{};
  w.N = codes.size(0) * T;
  w.K = codes.size(1) * B;
  const int64_t bytes = codes.size(2);
  TORCH_CHECK(bytes == T * B || bytes == T * B * 3 / 4 || bytes == T * B / 2,
              "ygg::qlinear: a code block must hold 8-, 6- or 4-bit codes");
  w.bits = bytes * 8 / (T * B);
  TORCH_CHECK(sc.size(0) * T == w.N && D.size(0) * T == w.N && sc.size(2) == T && D.size(2) == T,
              "ygg::qlinear: scales of another number of columns than the codes");
  TORCH_CHECK(w.K % sc.size(1) == 0 && w.K % D.size(1) == 0, "ygg::qlinear: groups must divide the input size");
  w.G = w.K / sc.size(1);
  w.S = w.K / D.size(1);
  TORCH_CHECK((w.G == 16 || w.G == 32) && (w.S == w.G || w.S == 256), "ygg::qlinear: groups of 16 or 32, super-blocks of one group or 256");
  TORCH_CHECK(x.size(-1) == w.K, "ygg::qlinear: x has ", x.size(-1), " features, the weights expect ", w.K);
  w.codes = codes.const_data_ptr<uint8_t>();
  w.D = D.const_data_ptr<float>();
  w.M = M.const_data_ptr<float>();
  w.sc = sc.const_data_ptr<int8_t>();
  w.mn = mn.numel() ? mn.const_data_ptr<int8_t>() : w.sc;  // Q6_K: its offset multiplier is its scale
  return w;
}

// x [..., K] -> [..., n] in x's dtype: the rows' float32 results plus the bias, rounded once. The
// codes may hold up to 15 rows of padding past n (a vocabulary that is not a multiple of 16).
at::Tensor run(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& D, const at::Tensor& M,
               const at::Tensor& sc, const at::Tensor& mn, const std::optional<at::Tensor>& bias, int64_t n,
               bool reference_only) {
  const Weights w = check(x_in, codes, D, M, sc, mn);
  TORCH_CHECK(n <= w.N && n > w.N - T, "ygg::qlinear: ", n, " outputs from codes of ", w.N, " rows");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.numel() / w.K;
  Activations a;
  switch (x.scalar_type()) {
    case at::kFloat: a = quantize(x.const_data_ptr<float>(), rows, w.K, w.G); break;
    case at::kBFloat16: a = quantize(x.const_data_ptr<c10::BFloat16>(), rows, w.K, w.G); break;
    case at::kHalf: a = quantize(x.const_data_ptr<c10::Half>(), rows, w.K, w.G); break;
    default: TORCH_CHECK(false, "ygg::qlinear: float32, bfloat16 or float16 inputs only");
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  std::vector<float> bias_f(n, 0.0f);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "ygg::qlinear: the bias has ", bias->numel(), " values, the output ", n);
    const at::Tensor bf = bias->to(at::kFloat).contiguous();
    std::memcpy(bias_f.data(), bf.const_data_ptr<float>(), n * sizeof(float));
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "qlinear_out", [&] {
    const Out<scalar_t> o{out.mutable_data_ptr<scalar_t>(), n, bias_f.data()};
    if (reference_only) {
      reference(w, a, rows, o);
      return;
    }
    const bool fast = std::strcmp(path(), "portable") != 0;
    at::parallel_for(0, w.N / T, 1, [&](int64_t t0, int64_t t1) {
#if defined(YGG_VNNI)
      if (fast) return tiles_simd<VNNI>(w, a, rows, o, t0, t1);
#elif defined(YGG_AVX2)
      if (fast) return tiles_simd<AVX2>(w, a, rows, o, t0, t1);
#endif
      (void)fast;
      tiles_portable(w, a, rows, o, t0, t1);
    });
  });
  return out;
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& D, const at::Tensor& M,
                   const at::Tensor& sc, const at::Tensor& mn, const std::optional<at::Tensor>& bias, int64_t n) {
  return run(x, codes, D, M, sc, mn, bias, n, false);
}

at::Tensor qlinear_reference(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& D, const at::Tensor& M,
                             const at::Tensor& sc, const at::Tensor& mn, const std::optional<at::Tensor>& bias, int64_t n) {
  return run(x, codes, D, M, sc, mn, bias, n, true);
}

// Which fast path this build runs (tests and `ygg inspect` report it).
std::string qlinear_path() { return path(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ygg, m) {
  m.def("qlinear(Tensor x, Tensor codes, Tensor D, Tensor M, Tensor sc, Tensor mn, Tensor? bias, int n) -> Tensor");
  m.def("qlinear_reference(Tensor x, Tensor codes, Tensor D, Tensor M, Tensor sc, Tensor mn, Tensor? bias, int n) -> Tensor");
  m.def("qlinear_path() -> str", &qlinear_path);
}
TORCH_LIBRARY_IMPL(ygg, CPU, m) {
  m.impl("qlinear", qlinear);
  m.impl("qlinear_reference", qlinear_reference);
}
