// ygg::qlinear — y = x W^T + b with W held as integer codes (2 to 8 bits) and group scales, for the
// 1..64 rows of a decode step or a tree verify, at the cost the machine's roofline allows.
//
// The cost model (benchmarks/roofline.py measures it on the machine; figures from a 2-core AMD EPYC
// with AVX-512 VNNI): one row is bound by reading the weights (~33 GB/s: ~4.5 bytes per cycle per
// core), and each further row costs int8 dot products (vpdpbusd: 64 multiply-adds per instruction,
// one per cycle per core). FMAs, float multiplies and vpmulld share that pipe; conversions, adds,
// logic and shifts do not (a register-only loop: 8 vpdpbusd + 4 FMAs take 12 cycles, 8 vpdpbusd + 4
// and/shifts take 8). So a kernel whose cost follows the roofline
//   - spends as few multiply-pipe instructions per weight as it can: the products of a group are
//     summed exactly in int32, scaled by the group's integer multiplier in int32 (one vpmulld per
//     group), and converted to float once per 256-column super-block per row (a K-quant's own
//     structure; llama.cpp's q4_K x q8_K does the same with activations quantized per 256);
//     (AVX2 has no int8 dot product: vpmaddubsw sums pairs into int16, vpmaddwd widens them; so a
//     group's products are summed in int16 first, exactly, and widened once: `AVX2::group`);
//   - unpacks a weight block once for up to 8 rows (the unpacking runs beside the dot products);
//   - keeps the weight stream going while it computes: tiles are contiguous records, and while a
//     tile is multiplied (in one pass per 8 rows) the next one is prefetched into L2, spread over
//     the passes, so memory and arithmetic overlap instead of adding up. A call that reads each
//     tile in one pass (1, 2, 4 or 8 rows) asks only a few lines ahead: its reads are one sequential
//     stream, which the hardware prefetchers follow alone, and asking a tile ahead as well only
//     took their line buffers (`prefetch_ahead`).
//
// The weight format (`ygg_runtime.quant` documents and packs it): a weight matrix is one or more
// row segments (the parts of a fused q/k/v or gate/up matrix keep their own formats), each
//   w[n, k] = D[n, s] * sc[n, j] * c[n, k] + M[n, s] * mn[n, j]
// with codes c in [0, 2^bits), groups j of G = 16 or 32 columns of k with int8 multipliers (sc, mn),
// super-blocks s of S = 256 columns (64 or 128 for rows without whole 256s) with float16 factors
// (D, M) — or S = G = 32 with sc = mn = 1 (a GGUF legacy block). When mn = sc and M = -off * D for
// an integer off (Q6_K: 32, Q8_0: 128, Q4_0: 8, Q5_0: 16), the segment is "folded":
// w = D * sc * (c - off), and neither M nor mn is stored.
//
// The arithmetic (its definition is `reference`, which every fast path equals bit for bit):
// activations are quantized per row and per S columns to int8 (a = da * q, |q| <= 127), and for
// each output, super-blocks s ascending,
//   dot_j  = sum over k in group j of c[k] * q[k]                      (int32, exact)
//   folded:  isum = sum_j sc_j * (dot_j - off * asum_j)                (int32, exact)
//            acc  = fma(float(isum), D_s * da_s, acc)
//   general: isum = sum_j sc_j * dot_j,  imin = sum_j mn_j * asum_j    (int32, exact)
//            acc  = fma(fma(D_s, float(isum), M_s * float(imin)), da_s, acc)
//   y = acc + b[n], rounded once to x's dtype
// (asum_j: the sum of the row's codes in group j). Integer sums are exact in any order, and the
// float steps are the same for every row, every number of rows, every thread count and every
// instruction set: a row's output is bitwise the same whatever the rows beside it (row invariance:
// the exactness of tree verification, `ygg_runtime.kernels`). int32 cannot overflow: |isum| <=
// 256 * 255 * 127 * 128 < 2^31.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define YGG_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define YGG_AMX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define YGG_AVX2 1
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cstdio>

namespace {

constexpr int T = 16;      // output columns per tile
constexpr int B = 32;      // columns of k per code block (8 quads of 4)
constexpr int MAX_NR = 8;  // rows that share one unpacked weight block
constexpr int TILE_ROWS = 64;  // rows the AMX path multiplies per pass (4 tiles of 16)
constexpr int PREFETCH_LOCALITY = 2;  // __builtin_prefetch's: into L2 (and the L3)
constexpr int64_t PREFETCH_NEAR = 4096, PREFETCH_FAR = 65536;  // bytes ahead: one pass a tile, or several

enum Flags : int64_t { HAS_SC = 1, GENERAL = 2 };  // a segment's layout[5]

// One row segment of a weight, as the layout tensor describes it ([rows, K, bits, G, S, flags, off]),
// with where its tiles' bytes are. A tile (T output columns) is K/S records, one per super-block,
// each holding in turn
//   codes [S/32 blocks][64 * bits bytes]  (see `code_at`)
//   sc    [S/G][T] int8                   (when HAS_SC)
//   mn    [S/G/2][T][2] int8               (when HAS_SC and GENERAL: group pairs, for vpdpwssd)
//   D     [T] float16
//   M     [T] float16                      (when GENERAL)
// so a thread reads its tiles as one sequential stream (what the hardware prefetchers follow best;
// separate arrays per field measured slower at one row). Every part is a multiple of 32 bytes.
struct Segment {
  int64_t rows, K, bits, G, S, flags, off;
  int64_t tiles, record_bytes, codes_bytes, sc_bytes, mn_bytes, tile_bytes;
  int64_t first_tile, first_byte, first_col;
  bool has_sc() const { return flags & HAS_SC; }
  bool general() const { return flags & GENERAL; }
};

Segment describe(const int64_t* f) {
  Segment s{};
  s.rows = f[0], s.K = f[1], s.bits = f[2], s.G = f[3], s.S = f[4], s.flags = f[5], s.off = f[6];
  TORCH_CHECK(s.rows > 0 && s.K > 0 && s.K % B == 0, "ygg::qlinear: a segment of ", s.rows, " rows and ", s.K, " inputs");
  TORCH_CHECK(s.bits == 2 || s.bits == 3 || s.bits == 4 || s.bits == 6 || s.bits == 8, "ygg::qlinear: ", s.bits, "-bit codes");
  TORCH_CHECK((s.G == 16 || s.G == 32) && s.K % s.S == 0 && s.off >= 0 && s.off < 256, "ygg::qlinear: a malformed segment layout");
  TORCH_CHECK(s.has_sc() ? (s.S == 64 || s.S == 128 || s.S == 256) : (s.S == 32 && s.G == 32),
              "ygg::qlinear: groups with multipliers in super-blocks of 64, 128 or 256, unit ones in blocks of 32");
  s.tiles = (s.rows + T - 1) / T;
  s.codes_bytes = s.S / B * 64 * s.bits;
  s.sc_bytes = s.has_sc() ? s.S / s.G * T : 0;
  s.mn_bytes = s.has_sc() && s.general() ? s.S / s.G * T : 0;
  s.record_bytes = s.codes_bytes + s.sc_bytes + s.mn_bytes + T * 2 * (s.general() ? 2 : 1);
  s.tile_bytes = s.K / s.S * s.record_bytes;
  return s;
}

// ---------------------------------------------------------------- activations

// A row's activations as int8 codes per super-block of S columns: a[k] ~= da[k / S] * q[k], and the
// sums of the codes per 16 columns (every group's sum is one or two of them).
// The codes are stored for the kernel's row blocks (8 rows at a time, then 4, 2, 1): a block of n
// rows from row r0 is [K/4 quads][n rows][4 bytes] at r0 * K, so the rows' quads that one weight
// quad multiplies are adjacent (one stream for the L1 to follow, not n).
struct Activations {
  int64_t S = 0, K = 0;
  std::vector<int8_t> tiled;   // [rows][K], row blocks with quads interleaved
  std::vector<float> da;       // [rows][K/S]
  std::vector<int32_t> sum16;  // [rows][K/16]
  std::vector<int32_t> block;  // per row: its block's first row and rows (r0 << 4 | n)
  std::vector<int8_t> plain;   // the tile path's: [rows rounded up to 16][K], row-major (an AMX tile's rows)
  int8_t at(int64_t m, int64_t k) const {  // the code of row m, column k
    const int64_t r0 = block[m] >> 4, n = block[m] & 15;
    return tiled[r0 * K + (k / 4) * n * 4 + (m - r0) * 4 + k % 4];
  }
};

// The kernel's row blocks: 8 rows at a time, then 4, 2 and 1 (start, rows).
template <typename F>
void row_blocks(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t left = rows - r0, n = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    f(r0, n);
    r0 += n;
  }
}

// 16 inputs as float32 (exactly), and 16 codes back: the vector paths of `quantize`.
#if defined(YGG_VNNI)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// One block of S inputs of one row: its int8 codes (as 16-code groups, handed to `put`), the sums of
// each 16, and da. Rounding is to nearest even, in float32, as std::nearbyint does by default.
template <typename X, typename Put>
float quantize_block(const X* x, int64_t S, int32_t* sum16, Put&& put) {
#if defined(YGG_VNNI)
  __m512 top = _mm512_setzero_ps();
  for (int64_t i = 0; i < S; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + i)));
  const float amax = _mm512_reduce_max_ps(top);
  const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m512 vid = _mm512_set1_ps(id);
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  for (int64_t i = 0; i < S; i += 16) {
    __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + i), vid));  // MXCSR: round to nearest even
    c = _mm512_max_epi32(_mm512_min_epi32(c, hi), lo);
    sum16[i / 16] = _mm512_reduce_add_epi32(c);
    alignas(16) int8_t codes[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(c));
    put(i, codes);
  }
  return d;
#else
  float v[256], amax = 0.0f;
  for (int64_t i = 0; i < S; ++i) {
    v[i] = static_cast<float>(x[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t i = 0; i < S; i += 16) {
    int8_t codes[16];
    int32_t total = 0;
    for (int64_t k = 0; k < 16; ++k) total += codes[k] = static_cast<int8_t>(std::clamp(std::nearbyint(v[i + k] * id), -127.0f, 127.0f));
    sum16[i / 16] = total;
    put(i, codes);
  }
  return d;
#endif
}

// plain: the row-major copy too (the tile path's)
template <typename X>
void quantize(const X* x, int64_t rows, int64_t K, Activations& a, bool plain) {
  const int64_t S = a.S;
  a.K = K;
  a.tiled.resize(rows * K);
  a.da.resize(rows * (K / S));
  a.sum16.resize(rows * (K / 16));
  a.block.resize(rows);
  row_blocks(rows, [&](int64_t r0, int64_t n) {
    for (int64_t m = r0; m < r0 + n; ++m) a.block[m] = static_cast<int32_t>(r0 << 4 | n);
  });
  if (plain) {  // a tile reads 16 rows: the rows past the last are zeros, never emitted
    a.plain.resize((rows + 15) / 16 * 16 * K);
    std::fill(a.plain.begin() + rows * K, a.plain.end(), int8_t{0});
  }
  // rows in parallel when there are many (a parallel region costs a few microseconds)
  at::parallel_for(0, rows, rows * K >= (1 << 20) ? 1 : rows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t r0 = a.block[m] >> 4, n = a.block[m] & 15;
      int8_t* row = a.tiled.data() + r0 * K + (m - r0) * 4;  // quad i of this row at row + i * n * 4
      for (int64_t b = 0; b < K / S; ++b)
        a.da[m * (K / S) + b] = quantize_block(x + m * K + b * S, S, a.sum16.data() + m * (K / 16) + b * S / 16,
                                               [&](int64_t i, const int8_t* codes) {
                                                 const int64_t quad = (b * S + i) / 4;
                                                 for (int j = 0; j < 4; ++j) std::memcpy(row + (quad + j) * n * 4, codes + 4 * j, 4);
                                                 if (plain) std::memcpy(a.plain.data() + m * K + b * S + i, codes, 16);
                                               });
    }
  });
}

// What one segment's kernel reads of the activations besides the codes: per row, off * asum_j
// (folded) or the groups' sums as int16 pairs (general, with multipliers) or per block (general).
struct RowSums {
  std::vector<int32_t> v;  // [rows][n]
  int64_t n = 0;
};

void row_sums(const Segment& s, const Activations& a, int64_t rows, RowSums& r) {
  const int64_t K = s.K, per = s.G / 16;
  auto group = [&](int64_t m, int64_t j) {
    int32_t t = 0;
    for (int64_t i = 0; i < per; ++i) t += a.sum16[m * (K / 16) + j * per + i];
    return t;
  };
  if (!s.general()) {  // off * (asum_0 + ... + asum_j), running through each super-block
    r.n = K / s.G;
    r.v.resize(rows * r.n);
    const int64_t per_s = s.S / s.G;
    for (int64_t m = 0; m < rows; ++m) {
      int32_t total = 0;
      for (int64_t j = 0; j < r.n; ++j) {
        total = j % per_s ? total + group(m, j) : group(m, j);
        r.v[m * r.n + j] = static_cast<int32_t>(s.off) * total;
      }
    }
  } else if (s.has_sc()) {
    r.n = K / s.G / 2;
    r.v.resize(rows * r.n);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t p = 0; p < r.n; ++p)
        r.v[m * r.n + p] = static_cast<int32_t>((static_cast<uint32_t>(group(m, 2 * p)) & 0xffffu) |
                                                (static_cast<uint32_t>(group(m, 2 * p + 1)) << 16));
  } else {
    r.n = K / s.G;
    r.v.resize(rows * r.n);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < r.n; ++j) r.v[m * r.n + j] = group(m, j);
  }
}

// ---------------------------------------------------------------- the weights' bytes

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// The code of column c, input k % 32, in a code block: the block is `bits` vectors of 64 bytes, each
// a quad-vector [16 columns][4 k] (one 32-bit lane per column, what vpdpbusd sums) split into bit
// planes: 8-bit codes are 8 quad-vectors as they are; a 4-bit plane holds quads 2i and 2i+1 in the
// low and high nibbles of one vector; a 2-bit plane quads 4i..4i+3 in bits 0-1, 2-3, 4-5, 6-7; a
// 1-bit plane quads 8i..8i+7 in bits 0..7. 6-bit codes are a 4-bit plane then a 2-bit plane (the
// high bits), 3-bit codes a 2-bit plane then a 1-bit plane (the high bit), 2-bit codes one plane.
inline int code_at(const uint8_t* block, int64_t bits, int64_t c, int64_t k) {
  const int64_t quad = k / 4, byte = c * 4 + k % 4;
  auto plane = [&](int64_t offset, int width) {  // the bits of this code in a plane of `width`
    const int per = 8 / width;
    return (block[offset + (quad / per) * 64 + byte] >> (width * (quad % per))) & ((1 << width) - 1);
  };
  switch (bits) {
    case 8: return block[quad * 64 + byte];
    case 6: return plane(0, 4) | plane(256, 2) << 4;
    case 4: return plane(0, 4);
    case 3: return plane(0, 2) | plane(128, 1) << 2;
    default: return plane(0, 2);
  }
}

// Super-block sb's record of a tile.
struct Record {
  const uint8_t* codes;
  const int8_t* sc;
  const int8_t* mn;
  const uint16_t* D;
  const uint16_t* M;
};

inline Record record(const Segment& s, const uint8_t* tile, int64_t sb) {
  const uint8_t* p = tile + sb * s.record_bytes;
  Record r{};
  r.codes = p;
  r.sc = reinterpret_cast<const int8_t*>(p + s.codes_bytes);
  r.mn = r.sc + s.sc_bytes;
  r.D = reinterpret_cast<const uint16_t*>(p + s.codes_bytes + s.sc_bytes + s.mn_bytes);
  r.M = r.D + T;
  return r;
}

// The definition: each output on its own, in the order the header states.
void reference(const Segment& s, const uint8_t* tile, const Activations& a, int64_t r0, int64_t rows, float* acc_out /*[rows][T]*/) {
  const int64_t K = s.K, KS = K / s.S, GS = s.S / s.G;
  for (int64_t m = r0; m < r0 + rows; ++m)
    for (int64_t c = 0; c < T; ++c) {
      float acc = 0.0f;
      for (int64_t sb = 0; sb < KS; ++sb) {
        const Record w = record(s, tile, sb);
        int32_t isum = 0, imin = 0;
        for (int64_t j = 0; j < GS; ++j) {
          const int64_t k0 = sb * s.S + j * s.G;
          int32_t dot = 0;
          for (int64_t k = k0; k < k0 + s.G; ++k)
            dot += code_at(w.codes + (k % s.S) / B * 64 * s.bits, s.bits, c, k % B) * a.at(m, k);
          int32_t asum = 0;
          for (int64_t i = k0 / 16; i < (k0 + s.G) / 16; ++i) asum += a.sum16[m * (K / 16) + i];
          if (!s.general()) dot -= static_cast<int32_t>(s.off) * asum;
          const int32_t sc = s.has_sc() ? w.sc[j * T + c] : 1;
          isum += sc * dot;
          if (s.general()) imin += (s.has_sc() ? w.mn[(j / 2) * 2 * T + c * 2 + j % 2] : 1) * asum;
        }
        const float D = half_to_float(w.D[c]), da = a.da[m * KS + sb];
        if (s.general()) {
          const float M = half_to_float(w.M[c]);
          acc = std::fma(std::fma(D, static_cast<float>(isum), M * static_cast<float>(imin)), da, acc);
        } else {
          acc = std::fma(static_cast<float>(isum), D * da, acc);
        }
      }
      acc_out[(m - r0) * T + c] = acc;
    }
}

// ---------------------------------------------------------------- the fast paths
//
// One body (`Rows::run`) over a small vector interface, three back ends: AVX-512 VNNI (16 columns
// in one vector), AVX2 (two halves of 8 columns: maddubs + madd for the quads), and plain C++ with
// GCC vector types. NR rows, the group G, the code width and the segment's kind are compile-time
// constants, so the loops unroll and the rows' sums stay in registers.

typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));
typedef uint8_t v64b __attribute__((vector_size(64)));

struct Portable {
  static constexpr int L = 16;
  static constexpr bool GROUPED = false;  // quad by quad into running sums (see AVX2::group)
  using C = v64b;  // a quad-vector of codes: L columns x 4 k
  using I = v16i;
  using F = v16f;
  static C load(const uint8_t* p, int) { C c; std::memcpy(&c, p, 64); return c; }
  static void store_c(uint8_t* p, C c) { std::memcpy(p, &c, 64); }
  static F load_f(const float* p) { F r; std::memcpy(&r, p, 64); return r; }
  static I load_i32(const int32_t* p) { I r; std::memcpy(&r, p, 64); return r; }
  static C band(C a, int m) { return a & static_cast<uint8_t>(m); }
  static C shr(C a, int n) { return a >> n; }
  static C shl_or(C a, C b, int n) { return a | static_cast<C>(b << n); }
  static I zero() { return I{}; }
  static I dot(I acc, C u, const int8_t* q) {
    for (int l = 0; l < L; ++l)
      for (int i = 0; i < 4; ++i) acc[l] += static_cast<int32_t>(u[4 * l + i]) * q[i];
    return acc;
  }
  static I add(I a, I b) { return a + b; }
  static I sub1(I a, int32_t b) { return a - b; }
  static I sub(I a, I b) { return a - b; }
  static I mullo(I a, I b) { return a * b; }
  static I load_i8(const int8_t* p, int) { I r; for (int l = 0; l < L; ++l) r[l] = p[l]; return r; }
  using P = std::array<int16_t, 2 * L>;  // group pairs of multipliers: [L][2] int16
  static P load_pairs(const int8_t* mn, int) { P p; for (int i = 0; i < 2 * L; ++i) p[i] = mn[i]; return p; }
  static I dot_pairs(I acc, const P& mn, const int32_t* pair) {  // x (lo, hi) int16
    const int32_t lo = static_cast<int16_t>(*pair & 0xffff), hi = static_cast<int16_t>(static_cast<uint32_t>(*pair) >> 16);
    for (int l = 0; l < L; ++l) acc[l] += mn[2 * l] * lo + mn[2 * l + 1] * hi;
    return acc;
  }
  static I set1(int32_t v) { return I{} + v; }
  static F cvt(I a) { return __builtin_convertvector(a, F); }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { F r; for (int l = 0; l < L; ++l) r[l] = std::fma(a[l], b[l], c[l]); return r; }
  static F set1f(float v) { return F{} + v; }
  static F load_half(const uint16_t* p, int) { F r; for (int l = 0; l < L; ++l) r[l] = half_to_float(p[l]); return r; }
  static void store(float* p, F a) { std::memcpy(p, &a, sizeof a); }
  static F zerof() { return F{}; }
};

#ifdef YGG_VNNI
struct AVX512 {
  static constexpr int L = 16;
  static constexpr bool GROUPED = false;  // vpdpbusd: a quad into int32 in one instruction
  using C = __m512i;
  using I = __m512i;
  using F = __m512;
  static C load(const uint8_t* p, int) { return _mm512_loadu_si512(p); }
  static void store_c(uint8_t* p, C c) { _mm512_storeu_si512(p, c); }
  static F load_f(const float* p) { return _mm512_loadu_ps(p); }
  static I load_i32(const int32_t* p) { return _mm512_loadu_si512(p); }
  static C band(C a, int m) { return _mm512_and_si512(a, _mm512_set1_epi8(static_cast<char>(m))); }
  static C shr(C a, int n) { return _mm512_srli_epi16(a, n); }
  static C shl_or(C a, C b, int n) { return _mm512_or_si512(a, _mm512_slli_epi16(b, n)); }
  static I zero() { return _mm512_setzero_si512(); }
  // The row's quad as vpdpbusd's embedded broadcast ({1to16}): GCC does not fold _mm512_set1_epi32
  // of a loaded quad into the memory operand, and a vpbroadcastd per vpdpbusd cost 11-14 % of 6- and
  // 8-bit forwards at 16-64 rows on the Zen 5 EPYC (docs/measured.md). The same instruction: same bits.
  typedef int32_t Quad __attribute__((may_alias));
  static I dot(I acc, C u, const int8_t* q) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const Quad*>(q)));
    return acc;
  }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub1(I a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I load_i8(const int8_t* p, int) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  using P = __m512i;
  static P load_pairs(const int8_t* mn, int) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn))); }
  // The pair broadcast from memory, as `dot`'s quad: a super-block's mins cost S / G / 2 of these a row
  // (4 for Q4_K's).
  static I dot_pairs(I acc, P mn, const int32_t* pair) {
    asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(mn), "m"(*reinterpret_cast<const Quad*>(pair)));
    return acc;
  }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F load_half(const uint16_t* p, int) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F zerof() { return _mm512_setzero_ps(); }
};
#endif

#ifdef YGG_AVX2
// 8 columns: the half `h` of a 16-column tile (bytes 32h.. of a quad-vector, 8h.. of a scale row).
template <int BITS>
struct AVX2 {
  static constexpr int L = 8;
  using C = __m256i;
  using I = __m256i;
  using F = __m256;
  static C load(const uint8_t* p, int h) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h)); }
  static C band(C a, int m) { return _mm256_and_si256(a, _mm256_set1_epi8(static_cast<char>(m))); }
  static C shr(C a, int n) { return _mm256_srli_epi16(a, n); }
  static C shl_or(C a, C b, int n) { return _mm256_or_si256(a, _mm256_slli_epi16(b, n)); }
  static I zero() { return _mm256_setzero_si256(); }
  // One group's dot for one row at once (`Rows` then scales it by the group's multiplier):
  // maddubs sums code x activation pairs into int16 (exact for codes below 64: 63 * 127 * 2 < 2^15;
  // 8-bit codes go in as two nibbles), and the quads' int16 sums are added before one madd widens
  // them, not a madd and an add per quad. Exact while the int16 sums stay below 2^15: 8 quads of
  // codes below 16 (4 bits and less, and each nibble), 2 of 6-bit codes (2 * 2 * 127 * 63 = 32 004).
  // q: the row's first quad; stride: bytes to its next.
  static constexpr bool GROUPED = true;
  template <int QG>
  static I group(const C* u, const int8_t* q, int64_t stride) {
    const __m256i ones = _mm256_set1_epi16(1);
    auto quad = [&](int i) {
      int32_t v;
      std::memcpy(&v, q + i * stride, 4);
      return _mm256_set1_epi32(v);
    };
    if constexpr (BITS == 8) {
      const __m256i low = _mm256_set1_epi8(15);
      __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
      for (int i = 0; i < QG; ++i) {
        const __m256i a = quad(i);
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(u[i], low), a));
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u[i], 4), low), a));
      }
      return _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_slli_epi32(_mm256_madd_epi16(hi, ones), 4));
    } else {
      constexpr int PER = BITS == 6 ? 2 : QG;  // products per int16 sum
      I acc = _mm256_setzero_si256();
      for (int c = 0; c < QG; c += PER) {
        __m256i p = _mm256_maddubs_epi16(u[c], quad(c));
        for (int i = c + 1; i < c + PER; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[i], quad(i)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
      }
      return acc;
    }
  }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub1(I a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I load_i8(const int8_t* p, int h) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h))); }
  using P = __m256i;
  static P load_pairs(const int8_t* mn, int h) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + 16 * h))); }
  static I dot_pairs(I acc, P mn, const int32_t* pair) { return _mm256_add_epi32(acc, _mm256_madd_epi16(mn, _mm256_set1_epi32(*pair))); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F load_half(const uint16_t* p, int h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h))); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static F zerof() { return _mm256_setzero_ps(); }
};
#endif

// The 8 quad-vectors of one code block (columns of half h), unpacked from its bit planes.
template <class V, int BITS>
inline void unpack(const uint8_t* block, int h, typename V::C u[8]) {
  if constexpr (BITS == 8) {
    for (int i = 0; i < 8; ++i) u[i] = V::load(block + 64 * i, h);
  } else if constexpr (BITS == 4 || BITS == 6) {
    for (int i = 0; i < 4; ++i) {
      const auto p = V::load(block + 64 * i, h);
      u[2 * i] = V::band(p, 15);
      u[2 * i + 1] = V::band(V::shr(p, 4), 15);
    }
    if constexpr (BITS == 6)
      for (int i = 0; i < 2; ++i) {
        const auto p = V::load(block + 256 + 64 * i, h);
        for (int j = 0; j < 4; ++j) u[4 * i + j] = V::shl_or(u[4 * i + j], V::band(V::shr(p, 2 * j), 3), 4);
      }
  } else {  // 2 or 3 bits: a 2-bit plane (quads 4i + j), then for 3 bits a 1-bit plane
    for (int i = 0; i < 2; ++i) {
      const auto p = V::load(block + 64 * i, h);
      for (int j = 0; j < 4; ++j) u[4 * i + j] = V::band(V::shr(p, 2 * j), 3);
    }
    if constexpr (BITS == 3) {
      const auto p = V::load(block + 128, h);
      for (int j = 0; j < 8; ++j) u[j] = V::shl_or(u[j], V::band(V::shr(p, j), 1), 2);
    }
  }
}

// The weight stream kept ahead of the arithmetic: a thread's tiles are one contiguous run of bytes,
// and at every super-block step the lines up to `ahead` bytes past its place in the run are asked
// for (its place: the tile's start plus the share of the tile done, over all passes; so while the
// passes of a tile of several row blocks compute from cache, the next tile streams in evenly).
struct Prefetch {
  const uint8_t* base;  // the thread's run of bytes
  int64_t end;          // its length
  int64_t done;         // asked for up to here
  int64_t want, step;   // where the next step asks up to, and by how much each step moves it
  int64_t ahead;        // bytes asked for ahead of the place
  void tile(int64_t start, int64_t bytes, int64_t steps) {  // a tile at `start` of the run, `steps` steps over all passes
    want = start + ahead, step = (bytes + steps - 1) / steps;
  }
  void advance() {
    want += step;
    for (const int64_t to = std::min(end, want); done < to; done += 64) __builtin_prefetch(base + done, 0, PREFETCH_LOCALITY);
  }
};

// The integer sums of a super-block, the same on every path. After group j a row's running sum
// (its dots through group j, never reset: a reset per group costs a register copy per row) is
//   R_j = dot_0 + ... + dot_j,  and  sum_j sc_j * dot_j = sum_j (sc_j - sc_{j+1}) * R_j  (sc_GS = 0)
// exactly in integers (wrapping int32 arithmetic gives the exact sum, which fits). Folded kinds
// take off * (asum_0 + ... + asum_j) (`RowSums`, running too) off R_j. step: sc_j - sc_{j+1}.
template <class V, bool SC, bool GEN>
inline typename V::I running_step(typename V::I isum, typename V::I run, typename V::I step, int32_t folded) {
  if constexpr (!GEN) run = V::sub1(run, folded);
  if constexpr (SC) return V::add(isum, V::mullo(run, step));
  else return run;  // one group per super-block
}

// A super-block's float step, the same on every path: a row's integer sum scaled by the tile's D
// (and, general kinds, its mins' sum by M), then by the row's activation scale, onto its float sum.
// Made once per super-block for every row (the mins' multipliers widened once).
// NP: the mins' group pairs of a super-block when known at compile time (256 columns: a K-quant's;
// 128: a row of 896), so that their products unroll; 0: counted at run time.
template <class V, int G, bool SC, bool GEN, int NP = 0>
struct Scale {
  using I = typename V::I;
  using F = typename V::F;
  F D, M;
  static constexpr int PAIRS = 256 / G / 2;  // the most group pairs a super-block has
  typename V::P mn[SC && GEN ? PAIRS : 1];
  int pairs;
  Scale(const Record& w, int h, int GS) : D(V::load_half(w.D, h)), pairs(GS / 2) {
    if constexpr (GEN) M = V::load_half(w.M, h);
    if constexpr (SC && GEN)
      for (int p = 0; p < pairs; ++p) mn[p] = V::load_pairs(w.mn + p * 2 * T, h);
  }
  // sums: the row's `RowSums` at this super-block; da: its activation scale here
  F apply(F acc, I isum, const int32_t* sums, float da) const {
    if constexpr (GEN) {
      I imin;
      if constexpr (SC) {  // in two chains, unrolled where the count is known (docs/measured.md)
        I i[2] = {V::zero(), V::zero()};
        const int n = NP ? NP : pairs;
        for (int p = 0; p < n; ++p) i[p % 2] = V::dot_pairs(i[p % 2], mn[p], sums + p);
        imin = V::add(i[0], i[1]);
      } else {
        imin = V::set1(sums[0]);
      }
      const F t = V::fma(D, V::cvt(isum), V::mul(M, V::cvt(imin)));
      return V::fma(t, V::set1f(da), acc);
    } else {
      return V::fma(V::cvt(isum), V::mul(D, V::set1f(da)), acc);
    }
  }
};

template <class V, int NR, int G, int BITS, bool SC, bool GEN>
struct Rows {
  // Rows r0..r0+NR of tile w (columns of half h): their float sums into acc [NR][T] (columns 8h..).
  static void run(const Segment& s, const uint8_t* tile, const Activations& a, const RowSums& rs, int64_t r0, int h,
                  float* acc_out, Prefetch& pf) {
    if constexpr (SC && GEN) {
      constexpr int P = Scale<V, G, SC, GEN>::PAIRS;  // a 256-column super-block's group pairs
      if (s.S == 256) return body<P>(s, tile, a, rs, r0, h, acc_out, pf);
      if (s.S == 128) return body<P / 2>(s, tile, a, rs, r0, h, acc_out, pf);
    }
    body<0>(s, tile, a, rs, r0, h, acc_out, pf);
  }
  template <int NP>
  static void body(const Segment& s, const uint8_t* tile, const Activations& a, const RowSums& rs, int64_t r0, int h,
                   float* acc_out, Prefetch& pf) {
    // super-blocks of 64 to 256 columns with multipliers (S runtime: a row of 896 takes 128), else of 32
    constexpr int QG = G / 4, GB = B / G, CH = NR >= 8 ? 1 : 8 / NR;
    const int S = SC ? static_cast<int>(s.S) : 32, BPS = S / B, GS = S / G;
    const int RN = !GEN ? GS : SC ? GS / 2 : 1;  // row sums per super-block (RowSums)
    const int64_t K = s.K, KS = K / S;
    using I = typename V::I;
    using F = typename V::F;
    F acc[NR];
    const int8_t* q = a.tiled.data() + r0 * K;  // [K/4][NR][4]: this block's rows, quads interleaved
    const float* da[NR];
    const int32_t* sums[NR];
    for (int r = 0; r < NR; ++r) {
      acc[r] = V::zerof();
      da[r] = a.da.data() + (r0 + r) * KS;
      sums[r] = rs.v.data() + (r0 + r) * rs.n;
    }
    for (int64_t sb = 0; sb < KS; ++sb) {
      pf.advance();
      const Record w = record(s, tile, sb);
      const uint8_t* codes = w.codes;
      // The products run on through the groups (`running_step`), NR x CH chains; a back end whose
      // quads cost more than a group's scaling (AVX2: V::group) takes each group's dot whole
      // instead, sum_j sc_j * (dot_j - off * asum_j): the same integer.
      I run[NR][CH], isum[NR];
      for (int r = 0; r < NR; ++r) {
        isum[r] = V::zero();
        for (int c = 0; c < CH; ++c) run[r][c] = V::zero();
      }
      I next = SC && !V::GROUPED ? V::load_i8(w.sc, h) : V::zero();  // sc of the group after the current one
      for (int bb = 0; bb < BPS; ++bb) {
        typename V::C u[8];
        unpack<V, BITS>(codes, h, u);
        codes += 64 * BITS;
        if constexpr (V::GROUPED) {
          for (int gi = 0; gi < GB; ++gi) {
            const int j = bb * GB + gi;
            const I scv = SC ? V::load_i8(w.sc + j * T, h) : V::zero();
            for (int r = 0; r < NR; ++r) {
              I d = V::template group<QG>(u + gi * QG, q + ((gi * G) / 4) * NR * 4 + 4 * r, NR * 4);
              if constexpr (!GEN) d = V::sub1(d, sums[r][j] - (j > 0 ? sums[r][j - 1] : 0));  // off * asum_j alone
              isum[r] = SC ? V::add(isum[r], V::mullo(d, scv)) : d;
            }
          }
        } else {
          for (int gi = 0; gi < GB; ++gi) {
            for (int i = 0; i < QG; ++i)  // rows innermost: NR x CH independent chains
              for (int r = 0; r < NR; ++r) run[r][i % CH] = V::dot(run[r][i % CH], u[gi * QG + i], q + ((gi * G) / 4 + i) * NR * 4 + 4 * r);
            const int j = bb * GB + gi;  // the group within the super-block
            I step = V::zero();
            if constexpr (SC) {
              const I scv = next;
              next = j + 1 < GS ? V::load_i8(w.sc + (j + 1) * T, h) : V::zero();
              step = V::sub(scv, next);
            }
            for (int r = 0; r < NR; ++r) {
              I d = run[r][0];
              for (int c = 1; c < CH; ++c) d = V::add(d, run[r][c]);
              isum[r] = running_step<V, SC, GEN>(isum[r], d, step, !GEN ? sums[r][j] : 0);
            }
          }
        }
        q += B * NR;
      }
      const Scale<V, G, SC, GEN, NP> scale(w, h, GS);
      for (int r = 0; r < NR; ++r) acc[r] = scale.apply(acc[r], isum[r], sums[r], da[r][sb]);
      for (int r = 0; r < NR; ++r) sums[r] += RN;
    }
    for (int r = 0; r < NR; ++r) V::store(acc_out + r * T + h * V::L, acc[r]);
  }
};

using RowsFn = void (*)(const Segment&, const uint8_t*, const Activations&, const RowSums&, int64_t, int, float*, Prefetch&);

// The functions for 1, 2, 4 and 8 rows of a segment's format through back end V.
template <template <int> class Back, int G, int BITS, bool SC, bool GEN>
std::array<RowsFn, 4> rows_for() {
  using V = Back<BITS>;
  return {&Rows<V, 1, G, BITS, SC, GEN>::run, &Rows<V, 2, G, BITS, SC, GEN>::run, &Rows<V, 4, G, BITS, SC, GEN>::run,
          &Rows<V, 8, G, BITS, SC, GEN>::run};
}

template <template <int> class Back, int G, bool SC, bool GEN>
std::array<RowsFn, 4> by_bits(int64_t bits) {
  switch (bits) {
    case 2: return rows_for<Back, G, 2, SC, GEN>();
    case 3: return rows_for<Back, G, 3, SC, GEN>();
    case 4: return rows_for<Back, G, 4, SC, GEN>();
    case 6: return rows_for<Back, G, 6, SC, GEN>();
    default: return rows_for<Back, G, 8, SC, GEN>();
  }
}

template <template <int> class Back>
std::array<RowsFn, 4> pick(const Segment& s) {
  if (!s.has_sc()) return s.general() ? by_bits<Back, 32, false, true>(s.bits) : by_bits<Back, 32, false, false>(s.bits);
  if (s.G == 16) return s.general() ? by_bits<Back, 16, true, true>(s.bits) : by_bits<Back, 16, true, false>(s.bits);
  return s.general() ? by_bits<Back, 32, true, true>(s.bits) : by_bits<Back, 32, true, false>(s.bits);
}

// ---------------------------------------------------------------- AMX tiles
//
// Intel AMX (Sapphire Rapids and later): one TDPBSUD multiplies a tile of 16 rows of int8
// activations (16 x G bytes, row-major) by a tile of G/4 quads of uint8 codes laid out [quad][16
// columns][4] — a code block's own layout, so unpacked codes go in as they are — into 16 x 16 int32
// sums, exactly: the work of 16 x G/4 vpdpbusd in one instruction. The integer sums are those of
// `Rows` (running through a super-block's groups, scaled by the multipliers' steps in int32) and the
// float steps after them are the same, so the bits are the same for every row (row invariance holds
// by construction, as for VNNI). The tiles: C0..C3 hold the running sums of up to 4 blocks of 16
// rows (64 rows: the codes are unpacked and loaded once for all of them), then A and B for groups
// of 32 columns and A and B for groups of 16.
//
// `EmulatedTiles` runs the same instructions in plain C++, as Intel's pseudo-code defines them, so
// the tile path's layout and arithmetic are tested on every CPU (YGG_QLINEAR=amx-emulated); the
// hardware runs `HardwareTiles` (YGG_QLINEAR=amx) where the CPU and the kernel build have AMX.

struct alignas(64) TileConfig {  // what LDTILECFG reads (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);
constexpr int TA32 = 4, TB32 = 5, TA16 = 6, TB16 = 7;

TileConfig tile_config() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;  // 16 rows x 16 int32 sums
  c.rows[TA32] = 16, c.colsb[TA32] = 32, c.rows[TB32] = 8, c.colsb[TB32] = 64;
  c.rows[TA16] = 16, c.colsb[TA16] = 16, c.rows[TB16] = 4, c.colsb[TB16] = 64;
  return c;
}

struct EmulatedTiles {
  struct State {
    TileConfig cfg;
    bool on = false;
    alignas(64) uint8_t t[8][16][64];
  };
  static State& raw() {
    thread_local State s;
    return s;
  }
  static State& state() {
    State& s = raw();
    if (!s.on) {  // what the hardware does too: a tile instruction before LDTILECFG faults
      std::fprintf(stderr, "ygg::qlinear: a tile instruction without a tile configuration\n");
      std::abort();
    }
    return s;
  }
  static void configure() {
    State& s = raw();
    s.cfg = tile_config(), s.on = true;
    std::memset(s.t, 0, sizeof s.t);
  }
  static void release() { raw().on = false; }
  template <int D> static void zero() { std::memset(state().t[D], 0, sizeof state().t[D]); }
  template <int D> static void load(const void* p, int64_t stride) {
    State& s = state();
    std::memset(s.t[D], 0, sizeof s.t[D]);
    for (int r = 0; r < s.cfg.rows[D]; ++r) std::memcpy(s.t[D][r], static_cast<const uint8_t*>(p) + r * stride, s.cfg.colsb[D]);
  }
  template <int D, int A, int Bt> static void dpbsud() {  // D += A (int8) x B (uint8), by quads
    State& s = state();
    if (s.cfg.rows[A] != s.cfg.rows[D] || s.cfg.colsb[A] / 4 != s.cfg.rows[Bt] || s.cfg.colsb[Bt] != s.cfg.colsb[D]) {
      std::fprintf(stderr, "ygg::qlinear: tiles of mismatched shapes\n");  // #UD on the hardware
      std::abort();
    }
    for (int m = 0; m < s.cfg.rows[D]; ++m)
      for (int n = 0; n < s.cfg.colsb[D] / 4; ++n) {
        uint32_t acc;
        std::memcpy(&acc, s.t[D][m] + 4 * n, 4);
        for (int k = 0; k < s.cfg.colsb[A] / 4; ++k)
          for (int i = 0; i < 4; ++i)
            acc += static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(s.t[A][m][4 * k + i])) *
                                         static_cast<int32_t>(s.t[Bt][k][4 * n + i]));
        std::memcpy(s.t[D][m] + 4 * n, &acc, 4);
      }
  }
  template <int D> static void store(void* p, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.cfg.rows[D]; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.t[D][r], s.cfg.colsb[D]);
  }
};

#ifdef YGG_AMX
// GCC's tile intrinsics paste their tile numbers into the assembly text: literals only, hence the
// one case per tile a kernel uses (C: 0-3, zeroed and stored; A, B: 4, 5 for groups of 32, 6, 7
// for 16, loaded).
struct HardwareTiles {
  static void configure() {
    static const TileConfig c = tile_config();
    _tile_loadconfig(&c);
  }
  static void release() { _tile_release(); }
  template <int D> static void zero() {
    static_assert(D >= 0 && D < 4);
    if constexpr (D == 0) _tile_zero(0);
    else if constexpr (D == 1) _tile_zero(1);
    else if constexpr (D == 2) _tile_zero(2);
    else _tile_zero(3);
  }
  template <int D> static void load(const void* p, int64_t stride) {
    static_assert(D >= 4 && D < 8);
    if constexpr (D == 4) _tile_loadd(4, p, stride);
    else if constexpr (D == 5) _tile_loadd(5, p, stride);
    else if constexpr (D == 6) _tile_loadd(6, p, stride);
    else _tile_loadd(7, p, stride);
  }
  template <int D, int A, int Bt> static void dpbsud() {
    static_assert(D >= 0 && D < 4 && ((A == TA32 && Bt == TB32) || (A == TA16 && Bt == TB16)));
    if constexpr (A == TA32) {
      if constexpr (D == 0) _tile_dpbsud(0, 4, 5);
      else if constexpr (D == 1) _tile_dpbsud(1, 4, 5);
      else if constexpr (D == 2) _tile_dpbsud(2, 4, 5);
      else _tile_dpbsud(3, 4, 5);
    } else {
      if constexpr (D == 0) _tile_dpbsud(0, 6, 7);
      else if constexpr (D == 1) _tile_dpbsud(1, 6, 7);
      else if constexpr (D == 2) _tile_dpbsud(2, 6, 7);
      else _tile_dpbsud(3, 6, 7);
    }
  }
  template <int D> static void store(void* p, int64_t stride) {
    static_assert(D >= 0 && D < 4);
    if constexpr (D == 0) _tile_stored(0, p, stride);
    else if constexpr (D == 1) _tile_stored(1, p, stride);
    else if constexpr (D == 2) _tile_stored(2, p, stride);
    else _tile_stored(3, p, stride);
  }
};
#endif

// Whether this process may use AMX: the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7), and Linux
// granted the tile data state, which it keeps off for a process until asked (arch_prctl).
bool amx_usable() {
  static const bool ok = [] {
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// Up to 64 rows r0.. of tile w: their float sums into acc_out [rows][T]. V: a back end of 16
// columns (AVX-512, or the plain C++ one), for the multipliers and the float steps.
template <class V, class Tiles, int G, int BITS, bool SC, bool GEN>
struct TileRows {
  template <int C>
  static void dot(const int8_t* a, int64_t K, int32_t* out) {  // C += A(rows at a) x B; C's sums to out
    constexpr int TA = G == 32 ? TA32 : TA16, TB = G == 32 ? TB32 : TB16;
    Tiles::template load<TA>(a, K);
    Tiles::template dpbsud<C, TA, TB>();
    Tiles::template store<C>(out, T * 4);
  }
  static void run(const Segment& s, const uint8_t* tile, const Activations& a, const RowSums& rs, int64_t r0, int64_t rows,
                  float* acc_out, Prefetch& pf) {
    constexpr int QG = G / 4, GB = B / G, TB = G == 32 ? TB32 : TB16;
    const int S = SC ? static_cast<int>(s.S) : 32, BPS = S / B, GS = S / G;
    const int RN = !GEN ? GS : SC ? GS / 2 : 1;
    const int64_t K = s.K, KS = K / S;
    const int blocks = static_cast<int>((rows + 15) / 16);
    using I = typename V::I;
    alignas(64) int32_t sums16[4][16][T];  // the C tiles' running sums: [block][row][column]
    alignas(64) uint8_t unpacked[8 * 64];  // a code block as a B tile: [8 quads][16 columns][4]
    I isum[TILE_ROWS];
    const int8_t* q = a.plain.data() + r0 * K;
    for (int64_t r = 0; r < rows; ++r) V::store(acc_out + r * T, V::zerof());
    for (int64_t sb = 0; sb < KS; ++sb) {
      pf.advance();
      const Record w = record(s, tile, sb);
      const uint8_t* codes = w.codes;
      const int32_t* sums = rs.v.data() + (r0 * rs.n) + sb * RN;  // row r's at sums + r * rs.n
      Tiles::template zero<0>(), Tiles::template zero<1>(), Tiles::template zero<2>(), Tiles::template zero<3>();
      for (int64_t r = 0; r < rows; ++r) isum[r] = V::zero();
      I next = SC ? V::load_i8(w.sc, 0) : V::zero();
      for (int bb = 0; bb < BPS; ++bb) {
        const uint8_t* quads = codes;  // 8-bit codes are a B tile as they are
        if constexpr (BITS != 8) {
          typename V::C u[8];
          unpack<V, BITS>(codes, 0, u);
          for (int i = 0; i < 8; ++i) V::store_c(unpacked + 64 * i, u[i]);
          quads = unpacked;
        }
        codes += 64 * BITS;
        for (int gi = 0; gi < GB; ++gi) {
          Tiles::template load<TB>(quads + gi * QG * 64, 64);
          const int8_t* qa = q + sb * S + bb * B + gi * G;
          dot<0>(qa, K, &sums16[0][0][0]);
          if (blocks > 1) dot<1>(qa + 16 * K, K, &sums16[1][0][0]);
          if (blocks > 2) dot<2>(qa + 32 * K, K, &sums16[2][0][0]);
          if (blocks > 3) dot<3>(qa + 48 * K, K, &sums16[3][0][0]);
          const int j = bb * GB + gi;
          I step = V::zero();
          if constexpr (SC) {
            const I scv = next;
            next = j + 1 < GS ? V::load_i8(w.sc + (j + 1) * T, 0) : V::zero();
            step = V::sub(scv, next);
          }
          for (int64_t r = 0; r < rows; ++r)  // the C tiles hold R_j, as Rows' chains do
            isum[r] = running_step<V, SC, GEN>(isum[r], V::load_i32(sums16[r / 16][r % 16]), step, !GEN ? sums[r * rs.n + j] : 0);
        }
      }
      const Scale<V, G, SC, GEN> scale(w, 0, GS);
      const float* da = a.da.data() + r0 * KS + sb;  // row r's at da[r * KS]
      for (int64_t r = 0; r < rows; ++r)
        V::store(acc_out + r * T, scale.apply(V::load_f(acc_out + r * T), isum[r], sums + r * rs.n, da[r * KS]));
    }
  }
};

using TileFn = void (*)(const Segment&, const uint8_t*, const Activations&, const RowSums&, int64_t, int64_t, float*, Prefetch&);

template <class V, class Tiles, int G, bool SC, bool GEN>
TileFn tiles_by_bits(int64_t bits) {
  switch (bits) {
    case 2: return &TileRows<V, Tiles, G, 2, SC, GEN>::run;
    case 3: return &TileRows<V, Tiles, G, 3, SC, GEN>::run;
    case 4: return &TileRows<V, Tiles, G, 4, SC, GEN>::run;
    case 6: return &TileRows<V, Tiles, G, 6, SC, GEN>::run;
    default: return &TileRows<V, Tiles, G, 8, SC, GEN>::run;
  }
}

template <class V, class Tiles>
TileFn pick_tiles(const Segment& s) {
  if (!s.has_sc()) return s.general() ? tiles_by_bits<V, Tiles, 32, false, true>(s.bits) : tiles_by_bits<V, Tiles, 32, false, false>(s.bits);
  if (s.G == 16) return s.general() ? tiles_by_bits<V, Tiles, 16, true, true>(s.bits) : tiles_by_bits<V, Tiles, 16, true, false>(s.bits);
  return s.general() ? tiles_by_bits<V, Tiles, 32, true, true>(s.bits) : tiles_by_bits<V, Tiles, 32, true, false>(s.bits);
}

template <int> using PortableOf = Portable;
#ifdef YGG_VNNI
template <int> using AVX512Of = AVX512;
using Wide = AVX512;  // the back end of 16 columns the tile path scales with
#else
using Wide = Portable;
#endif

// Which implementation runs: the fastest this build has ("avx512-vnni", "avx2"), unless YGG_QLINEAR
// asks for another: "portable" (the plain C++ one), "amx" (AMX tiles, where the CPU and this build
// have them; else the build's fastest, as the path reported says), "amx-emulated" (the tile path
// with its instructions emulated: tests). Tests compare them; benchmarks time them. AMX is not the
// default yet: from which width it pays is to be measured on a Xeon (benchmarks/qlinear_kernels.py).
enum class Path { Portable, AVX2, VNNI, AMX, AMXEmulated };

Path chosen() {
  static const Path p = [] {
    const char* e = std::getenv("YGG_QLINEAR");
    const std::string want = e != nullptr ? e : "";
    if (want == "portable") return Path::Portable;
    if (want == "amx-emulated") return Path::AMXEmulated;
#if defined(YGG_AMX)
    if (want == "amx" && amx_usable()) return Path::AMX;
#endif
#if defined(YGG_VNNI)
    return Path::VNNI;
#elif defined(YGG_AVX2)
    return Path::AVX2;
#else
    return Path::Portable;
#endif
  }();
  return p;
}

const char* path() {
  switch (chosen()) {
    case Path::VNNI: return "avx512-vnni";
    case Path::AVX2: return "avx2";
    case Path::AMX: return "amx";
    case Path::AMXEmulated: return "amx-emulated";
    default: return "portable";
  }
}

bool tiled() { return chosen() == Path::AMX || chosen() == Path::AMXEmulated; }

void configure_tiles(bool on) {
#if defined(YGG_AMX)
  if (chosen() == Path::AMX) return on ? HardwareTiles::configure() : HardwareTiles::release();
#endif
  if (chosen() == Path::AMXEmulated) on ? EmulatedTiles::configure() : EmulatedTiles::release();
}

TileFn tile_function(const Segment& s) {
#if defined(YGG_AMX)
  if (chosen() == Path::AMX) return pick_tiles<Wide, HardwareTiles>(s);
#endif
  return pick_tiles<Wide, EmulatedTiles>(s);
}

// How far ahead of its place a thread asks for weight bytes. Where a call reads each tile in one
// pass (1, 2, 4 or 8 rows on the AVX-512 and plain C++ paths), its reads are one sequential stream
// and the hardware prefetchers keep it going: asking a tile (64 kB) ahead too cost the Zen 5 EPYC's
// compiled target 11-16 % at 1-2 rows; 4 kB is best at 1-8 (docs/measured.md). Where a tile takes
// several passes (3, 5-7 or more than 8 rows; AVX2's two halves), the next tile must be asked for
// while the current one is multiplied from cache: 64 kB (4 kB took 1.6-1.8x as long at 3-16 rows).
// The AMX path keeps 64 kB: not measured on AMX hardware. YGG_PREFETCH fixes one distance for
// every call (tuning: benchmarks/qlinear_prefetch.py).
int64_t prefetch_ahead(bool one_pass) {
  static const int64_t forced = [] {
    const char* e = std::getenv("YGG_PREFETCH");
    return e != nullptr ? std::atoll(e) : int64_t{-1};
  }();
  return forced >= 0 ? forced : one_pass ? PREFETCH_NEAR : PREFETCH_FAR;
}

std::array<RowsFn, 4> functions(const Segment& s) {
#if defined(YGG_VNNI)
  if (chosen() == Path::VNNI) return pick<AVX512Of>(s);
#elif defined(YGG_AVX2)
  if (chosen() == Path::AVX2) return pick<AVX2>(s);
#endif
  return pick<PortableOf>(s);
}

int halves() { return chosen() == Path::AVX2 ? 2 : 1; }

// ---------------------------------------------------------------- the operator

std::vector<Segment> segments(const at::Tensor& data, const at::Tensor& layout) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "ygg::qlinear: data must be a contiguous uint8 vector on the CPU");
  TORCH_CHECK(layout.device().is_cpu() && layout.scalar_type() == at::kLong && layout.dim() == 2 && layout.size(1) == 7 &&
              layout.size(0) > 0 && layout.is_contiguous(), "ygg::qlinear: layout must be int64 [segments, 7]");
  std::vector<Segment> out;
  int64_t tile = 0, byte = 0, col = 0;
  for (int64_t i = 0; i < layout.size(0); ++i) {
    Segment s = describe(layout.const_data_ptr<int64_t>() + 7 * i);
    TORCH_CHECK(out.empty() || s.K == out[0].K, "ygg::qlinear: segments of different input sizes");
    s.first_tile = tile, s.first_byte = byte, s.first_col = col;
    tile += s.tiles, byte += s.tiles * s.tile_bytes, col += s.rows;
    out.push_back(s);
  }
  TORCH_CHECK(byte == data.numel(), "ygg::qlinear: the layout describes ", byte, " bytes, data holds ", data.numel());
  return out;
}

// A tile's results: rows of 16 float32 sums plus the bias, rounded once to the output's dtype (to
// nearest even, NaN to bfloat16's canonical NaN, exactly as c10's conversions) and stored.
template <typename O>
void emit(O* out, int64_t n, const float* bias, const float* acc, int64_t rows, int64_t row0, int64_t col0, int64_t cols) {
#if defined(YGG_VNNI)
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = _mm512_maskz_loadu_ps(keep, bias + col0);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 y = _mm512_add_ps(_mm512_loadu_ps(acc + r * T), b);
    O* dst = out + (row0 + r) * n + col0;
    if constexpr (std::is_same_v<O, float>) {
      _mm512_mask_storeu_ps(dst, keep, y);
    } else if constexpr (std::is_same_v<O, c10::BFloat16>) {
      const __m512i bits = _mm512_castps_si512(y);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
      h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
      _mm256_mask_storeu_epi16(dst, keep, _mm512_cvtepi32_epi16(h));
    } else if constexpr (std::is_same_v<O, c10::Half>) {
      _mm256_mask_storeu_epi16(dst, keep, _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<O>(acc[r * T + c] + bias[col0 + c]);
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[(row0 + r) * n + col0 + c] = static_cast<O>(acc[r * T + c] + bias[col0 + c]);
#endif
}

// Each thread takes a run of whole tiles holding an equal share of the bytes (segments of other
// code widths cost more per tile): thread th starts at the first tile that starts at or past th /
// threads of them. split: each run's first tile (and the end); split_bytes: its first byte.
void split_runs(const std::vector<Segment>& segs, int64_t total, int threads, std::vector<int64_t>& split,
                std::vector<int64_t>& split_bytes) {
  const int64_t tiles = segs.back().first_tile + segs.back().tiles;
  split.assign(threads + 1, tiles);
  split_bytes.assign(threads + 1, total);
  split[0] = split_bytes[0] = 0;
  for (int th = 1; th < threads; ++th) {
    const int64_t target = total * th / threads;
    for (const Segment& s : segs)
      if (target < s.first_byte + s.tiles * s.tile_bytes) {
        const int64_t i = (target - s.first_byte + s.tile_bytes - 1) / s.tile_bytes;
        split[th] = s.first_tile + i, split_bytes[th] = s.first_byte + i * s.tile_bytes;
        break;
      }
  }
}

// What a call needs besides its inputs, kept per calling thread so that a forward's hundred calls
// allocate nothing (a call on a small matrix costs a few microseconds; allocations were a third).
struct Scratch {
  Activations acts[4];  // per super-block size: 256, 128, 64, 32
  std::vector<RowSums> sums;
  std::vector<float> bias;
};

// x [..., K] -> [..., n] in x's dtype: the rows' float32 results plus the bias, rounded once.
at::Tensor run(const at::Tensor& x_in, const at::Tensor& data, const at::Tensor& layout, const std::optional<at::Tensor>& bias,
               int64_t n, bool reference_only) {
  const std::vector<Segment> segs = segments(data, layout);
  const int64_t K = segs[0].K, N = segs.back().first_col + segs.back().rows, tiles = segs.back().first_tile + segs.back().tiles;
  TORCH_CHECK(n == N, "ygg::qlinear: ", n, " outputs asked of weights with ", N);
  TORCH_CHECK(x_in.device().is_cpu(), "ygg::qlinear: CPU tensors only");
  TORCH_CHECK(x_in.size(-1) == K, "ygg::qlinear: x has ", x_in.size(-1), " features, the weights expect ", K);
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.numel() / K;
  thread_local Scratch scratch;
  Activations* by_s[4] = {nullptr, nullptr, nullptr, nullptr};
  for (const Segment& s : segs) {
    const int i = s.S == 256 ? 0 : s.S == 128 ? 1 : s.S == 64 ? 2 : 3;
    if (by_s[i]) continue;
    Activations& a = *(by_s[i] = &scratch.acts[i]);
    a.S = s.S;
    const bool plain = tiled() && !reference_only;
    switch (x.scalar_type()) {
      case at::kFloat: quantize(x.const_data_ptr<float>(), rows, K, a, plain); break;
      case at::kBFloat16: quantize(x.const_data_ptr<c10::BFloat16>(), rows, K, a, plain); break;
      case at::kHalf: quantize(x.const_data_ptr<c10::Half>(), rows, K, a, plain); break;
      default: TORCH_CHECK(false, "ygg::qlinear: float32, bfloat16 or float16 inputs only");
    }
  }
  auto acts_of = [&](const Segment& s) -> const Activations& { return *by_s[s.S == 256 ? 0 : s.S == 128 ? 1 : s.S == 64 ? 2 : 3]; };
  std::vector<RowSums>& sums = scratch.sums;
  sums.resize(segs.size());
  const bool amx = tiled() && !reference_only;
  std::vector<std::array<RowsFn, 4>> fns;
  std::vector<TileFn> tile_fns;
  for (size_t i = 0; i < segs.size(); ++i) {
    row_sums(segs[i], acts_of(segs[i]), rows, sums[i]);
    if (amx) tile_fns.push_back(tile_function(segs[i]));
    else fns.push_back(functions(segs[i]));
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  std::vector<float>& bias_f = scratch.bias;
  bias_f.assign(n, 0.0f);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous(), "ygg::qlinear: the bias has ", bias->numel(), " values, the output ", n);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bias->scalar_type(), "qlinear_bias", [&] {
      const scalar_t* b = bias->const_data_ptr<scalar_t>();
      for (int64_t i = 0; i < n; ++i) bias_f[i] = static_cast<float>(b[i]);
    });
  }
  const uint8_t* bytes = data.const_data_ptr<uint8_t>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles)));
  // rows go 8 at a time, then 4, 2, 1: one pass over a tile each (AVX2: each half a pass)
  const int64_t passes = (rows / MAX_NR + __builtin_popcountll(rows % MAX_NR)) * halves();
  const int64_t ahead = prefetch_ahead(!amx && passes == 1);
  std::vector<int64_t> split, split_bytes;
  split_runs(segs, data.numel(), threads, split, split_bytes);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "qlinear_out", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, threads, 1, [&](int64_t th0, int64_t th1) {
      alignas(64) float acc[TILE_ROWS * T];
      if (amx) configure_tiles(true);  // a thread's tile state is its own
      for (int64_t th = th0; th < th1; ++th) {
        size_t si = 0;
        const uint8_t* run = bytes + split_bytes[th];
        Prefetch pf{run, split_bytes[th + 1] - split_bytes[th], 0, 0, 0, ahead};
        for (int64_t t = split[th]; t < split[th + 1]; ++t) {
          while (t >= segs[si].first_tile + segs[si].tiles) ++si;
          const Segment& s = segs[si];
          const int64_t lt = t - s.first_tile, cols = std::min<int64_t>(T, s.rows - lt * T);
          const uint8_t* w = bytes + s.first_byte + lt * s.tile_bytes;
          const Activations& a = acts_of(s);
          if (reference_only) {
            for (int64_t r0 = 0; r0 < rows; r0 += MAX_NR) {
              const int64_t nr = std::min<int64_t>(MAX_NR, rows - r0);
              reference(s, w, a, r0, nr, acc);
              emit(o, n, bias_f.data(), acc, nr, r0, s.first_col + lt * T, cols);
            }
            continue;
          }
          if (amx) {  // 64 rows at a time: one pass over the tile each
            pf.tile(w - run, s.tile_bytes, (rows + TILE_ROWS - 1) / TILE_ROWS * (s.K / s.S));
            for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
              const int64_t nr = std::min<int64_t>(TILE_ROWS, rows - r0);
              tile_fns[si](s, w, a, sums[si], r0, nr, acc, pf);
              emit(o, n, bias_f.data(), acc, nr, r0, s.first_col + lt * T, cols);
            }
            continue;
          }
          pf.tile(w - run, s.tile_bytes, passes * (s.K / s.S));
          row_blocks(rows, [&](int64_t r0, int64_t nr) {
            const int idx = nr == 8 ? 3 : nr == 4 ? 2 : nr == 2 ? 1 : 0;
            for (int h = 0; h < halves(); ++h) fns[si][idx](s, w, a, sums[si], r0, h, acc, pf);
            emit(o, n, bias_f.data(), acc, nr, r0, s.first_col + lt * T, cols);
          });
        }
      }
      if (amx) configure_tiles(false);
    });
  });
  return out;
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& layout, const std::optional<at::Tensor>& bias,
                   int64_t n) {
  return run(x, data, layout, bias, n, false);
}

at::Tensor qlinear_reference(const at::Tensor& x, const at::Tensor& data, const at::Tensor& layout,
                             const std::optional<at::Tensor>& bias, int64_t n) {
  return run(x, data, layout, bias, n, true);
}

// Which fast path this build runs (tests and `ygg inspect` report it).
std::string qlinear_path() { return path(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ygg, m) {
  m.def("qlinear(Tensor x, Tensor data, Tensor layout, Tensor? bias, int n) -> Tensor");
  m.def("qlinear_reference(Tensor x, Tensor data, Tensor layout, Tensor? bias, int n) -> Tensor");
  m.def("qlinear_path() -> str", &qlinear_path);
}
TORCH_LIBRARY_IMPL(ygg, CPU, m) {
  m.impl("qlinear", qlinear);
  m.impl("qlinear_reference", qlinear_reference);
}
