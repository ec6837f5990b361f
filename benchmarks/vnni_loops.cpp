// How fast can ygg::qlinear's inner loop go on one core? Register- and L3-fed loops with the
// kernel's instruction mix, each timed alone, so a kernel's measured G MAC/s can be set against the
// ceiling of its own arithmetic rather than against the bare vpdpbusd peak.
//
//     g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni benchmarks/vnni_loops.cpp -o /tmp/vnni_loops
//     /tmp/vnni_loops        # alone on the machine; one thread; needs AVX-512 VNNI
//
// Loops (8 rows of activations, 16 output columns per vector, 4-bit codes as Q4_K holds them):
//   peak      vpdpbusd on registers only (the roof of ygg::int8_peak, per core)
//   mix       each multiply-pipe instruction alone, 12 chains: vpdpbusd, vpmulld, vpmaddwd, vfmadd,
//             vpdpwssd; then vpdpbusd interleaved with vpmulld and with vfmadd: when the pair runs no
//             faster than one alone, they share a slot (Zen 4: they do, so the kernel's budget per
//             cycle is one of any of them)
//   unpack    weights streamed from an 8 MB buffer (L3), unpacked once (and, shift) for 8 rows, an
//             activation quad broadcast per vpdpbusd: the kernel's product loop without group scales
//   scaled    unpack + the int32 group scaling (one vpmulld + vpaddd per row per 32 columns of k):
//             the kernel's loop for Q4_K (docs/measured.md sets ygg::qlinear's figures beside these)
//   2-tiles   unpack with one broadcast feeding two tiles of columns (no scaling: 8 rows x 2 tiles
//             needs 16 accumulators, and the scaled sums would not fit the 32 registers)
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

alignas(64) int8_t acts[1 << 14];
std::vector<uint8_t> weights(1 << 24);

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
__m512i bcast(const int8_t* p) { int32_t x; std::memcpy(&x, p, 4); return _mm512_set1_epi32(x); }
__m512i sum(const __m512i* a, int n) { __m512i s = a[0]; for (int i = 1; i < n; ++i) s = _mm512_add_epi32(s, a[i]); return s; }

template <int OP>
__attribute__((noinline)) __m512i mix(long n) {
  __m512i a[12];
  for (int r = 0; r < 12; ++r) a[r] = _mm512_set1_epi32(r + 1);
  __m512i u = _mm512_set1_epi8(3), v = _mm512_set1_epi8(5);
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 12
    for (int r = 0; r < 12; ++r) {
      if constexpr (OP == 0) a[r] = _mm512_dpbusd_epi32(a[r], u, v);
      if constexpr (OP == 1) a[r] = _mm512_mullo_epi32(a[r], u);
      if constexpr (OP == 2) a[r] = _mm512_madd_epi16(a[r], u);
      if constexpr (OP == 3) a[r] = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(a[r]), _mm512_castsi512_ps(u), _mm512_castsi512_ps(v)));
      if constexpr (OP == 4) a[r] = _mm512_dpwssd_epi32(a[r], u, v);
      if constexpr (OP == 5) a[r] = r % 2 ? _mm512_mullo_epi32(a[r], u) : _mm512_dpbusd_epi32(a[r], u, v);
      if constexpr (OP == 6) a[r] = r % 2 ? _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(a[r]), _mm512_castsi512_ps(u), _mm512_castsi512_ps(v)))
                                          : _mm512_dpbusd_epi32(a[r], u, v);
    }
    asm volatile("" : "+v"(u), "+v"(v));  // keep the operands live
  }
  return sum(a, 12);
}

// 8 quad-vectors of one 32-column code block (4 vectors of two nibbles each)
inline void unpack4(const uint8_t* p, __m512i u[8]) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int j = 0; j < 4; ++j) {
    const __m512i x = _mm512_loadu_si512(p + 64 * j);
    u[2 * j] = _mm512_and_si512(x, low);
    u[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
  }
}

template <bool SCALED>
__attribute__((noinline)) __m512i eight_rows(long n) {
  __m512i run[8], isum[8];
  for (int r = 0; r < 8; ++r) run[r] = isum[r] = _mm512_setzero_si512();
  const uint8_t* w = weights.data();
  for (long i = 0; i < n; ++i) {
    const int8_t* q = acts + (i & 31) * 256;          // [8 quads][8 rows][4]
    const uint8_t* block = w + (i & 32767) * 272;     // 256 bytes of codes, 16 group scales
    __m512i u[8];
    unpack4(block, u);
#pragma GCC unroll 64
    for (int j = 0; j < 64; ++j) run[j % 8] = _mm512_dpbusd_epi32(run[j % 8], u[j / 8], bcast(q + 4 * j));
    if constexpr (SCALED) {
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 256)));
      for (int r = 0; r < 8; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(run[r], sc));
    }
  }
  return _mm512_add_epi32(sum(run, 8), sum(isum, 8));
}

__attribute__((noinline)) __m512i two_tiles(long n) {
  __m512i a[16];
  for (int r = 0; r < 16; ++r) a[r] = _mm512_setzero_si512();
  const uint8_t* w = weights.data();
  const __m512i low = _mm512_set1_epi8(15);
  for (long i = 0; i < n; ++i) {
    const int8_t* q = acts + (i & 31) * 256;
    const uint8_t* pair = w + (i & 16383) * 512;     // two tiles' code blocks side by side
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m512i u[4], v[4];
      for (int j = 0; j < 2; ++j) {
        const __m512i x = _mm512_loadu_si512(pair + 128 * half + 64 * j), y = _mm512_loadu_si512(pair + 256 + 128 * half + 64 * j);
        u[2 * j] = _mm512_and_si512(x, low), u[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
        v[2 * j] = _mm512_and_si512(y, low), v[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(y, 4), low);
      }
#pragma GCC unroll 32
      for (int j = 0; j < 32; ++j) {
        const __m512i b = bcast(q + 128 * half + 4 * j);
        a[j % 8] = _mm512_dpbusd_epi32(a[j % 8], u[j / 8], b);
        a[8 + j % 8] = _mm512_dpbusd_epi32(a[8 + j % 8], v[j / 8], b);
      }
    }
  }
  return sum(a, 16);
}

template <class F>
double best_seconds(F f, long n) {
  f(n / 8);  // warm up (and fault the buffers in)
  double best = 1e9;
  for (int k = 0; k < 7; ++k) {
    const double t = now();
    volatile __m512i r = f(n);
    (void)r;
    best = std::min(best, now() - t);
  }
  return best;
}

}  // namespace

int main() {
  for (int i = 0; i < (1 << 14); ++i) acts[i] = static_cast<int8_t>(i * 7);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<uint8_t>(i * 13);
  const long n = 1 << 20;
  const double peak = n * 12.0 * 64 / best_seconds(mix<0>, n) / 1e9;
  std::printf("%-10s %7.1f G MAC/s  (vpdpbusd %.2f G/s)\n", "peak", peak, peak / 64);
  const char* names[] = {"vpdpbusd", "vpmulld", "vpmaddwd", "vfmadd", "vpdpwssd"};
  const double rates[] = {n * 12.0 / best_seconds(mix<0>, n) / 1e9, n * 12.0 / best_seconds(mix<1>, n) / 1e9,
                          n * 12.0 / best_seconds(mix<2>, n) / 1e9, n * 12.0 / best_seconds(mix<3>, n) / 1e9,
                          n * 12.0 / best_seconds(mix<4>, n) / 1e9};
  std::printf("%-10s", "mix");
  for (int i = 0; i < 5; ++i) std::printf(" %s %.2f G/s;", names[i], rates[i]);
  std::printf("\n%-10s vpdpbusd+vpmulld %.2f G/s; vpdpbusd+vfmadd %.2f G/s (about 2x one alone if they do not share)\n", "pairs",
              n * 12.0 / best_seconds(mix<5>, n) / 1e9, n * 12.0 / best_seconds(mix<6>, n) / 1e9);
  const long m = 1 << 17;
  const double unpack = m * 64.0 * 64 / best_seconds(eight_rows<false>, m) / 1e9;
  const double scaled = m * 64.0 * 64 / best_seconds(eight_rows<true>, m) / 1e9;
  const double tiles = m * 128.0 * 64 / best_seconds(two_tiles, m) / 1e9;
  std::printf("%-10s %7.1f G MAC/s  %3.0f%% of peak\n", "unpack", unpack, 100 * unpack / peak);
  std::printf("%-10s %7.1f G MAC/s  %3.0f%% of peak  (64 vpdpbusd + 8 vpmulld per block: %.0f%% if they share a slot)\n",
              "scaled", scaled, 100 * scaled / peak, 100.0 * 64 / 72);
  std::printf("%-10s %7.1f G MAC/s  %3.0f%% of peak\n", "2-tiles", tiles, 100 * tiles / peak);
}
