// The machine's two roofs, measured with the threads the kernels run on (`benchmarks/roofline.py`,
// `ygg inspect`): no forward can beat max(weight bytes / read bandwidth, multiply-adds / int8 peak).
//
// ygg::int8_peak — int8 multiply-adds per second of a register-only loop of the instruction
// `ygg::qlinear`'s fast path multiplies with (vpdpbusd with AVX-512 VNNI: 64 per instruction; AVX2:
// maddubs + madd, 32 per pair; plain C++ otherwise), enough independent chains to hide its latency.
// ygg::read_bandwidth — bytes per second of a streaming read of a buffer far larger than the caches,
// each thread reading its own contiguous share (as the kernel's threads read their tiles).
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define YGG_PEAK_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define YGG_PEAK_AVX2 1
#endif

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// `iters` rounds of 8 independent multiply-add chains on one thread; returns the multiply-adds done.
int64_t spin(int64_t iters, int seed) {
#if defined(YGG_PEAK_VNNI)
  __m512i a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm512_set1_epi32(i + seed);
  const __m512i u = _mm512_set1_epi8(static_cast<char>(3 + seed)), v = _mm512_set1_epi8(5);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 8; ++i) a[i] = _mm512_dpbusd_epi32(a[i], u, v);
  __m512i t = a[0];
  for (int i = 1; i < 8; ++i) t = _mm512_add_epi32(t, a[i]);
  volatile int32_t sink = _mm512_reduce_add_epi32(t);
  (void)sink;
  return iters * 8 * 64;
#elif defined(YGG_PEAK_AVX2)
  __m256i a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_set1_epi32(i + seed);
  const __m256i u = _mm256_set1_epi8(static_cast<char>(3 + seed)), v = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 8; ++i) a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), ones));
  __m256i t = a[0];
  for (int i = 1; i < 8; ++i) t = _mm256_add_epi32(t, a[i]);
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), t);
  volatile int32_t sink = out[0];
  (void)sink;
  return iters * 8 * 32;
#else
  typedef int32_t v16i __attribute__((vector_size(64)));
  v16i a[8];
  for (int i = 0; i < 8; ++i) a[i] = v16i{} + (i + seed);
  v16i u = v16i{} + (3 + seed), v = v16i{} + 5;
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 8; ++i) a[i] += u * v;
  volatile int32_t sink = a[0][0] + a[7][15];
  (void)sink;
  return iters * 8 * 16;
#endif
}

// Multiply-adds per second on the torch threads, the best of `repeats` runs of about `seconds`.
double int8_peak(double seconds, int64_t repeats) {
  const int threads = at::get_num_threads();
  int64_t iters = 1 << 16;
  double t0 = now();
  spin(iters, 0);
  const double one = std::max(now() - t0, 1e-6);
  iters = std::max<int64_t>(iters, static_cast<int64_t>(iters * seconds / one));
  double best = 0.0;
  for (int64_t r = 0; r < repeats; ++r) {
    std::vector<int64_t> done(threads, 0);
    t0 = now();
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) done[t] = spin(iters, static_cast<int>(t));
    });
    const double dt = now() - t0;
    int64_t total = 0;
    for (int64_t d : done) total += d;
    best = std::max(best, total / dt);
  }
  return best;
}

// Bytes per second of reading `bytes` (rounded to whole 256-byte lines per thread), best of `repeats`.
double read_bandwidth(int64_t bytes, int64_t repeats) {
  const int threads = at::get_num_threads();
  const int64_t per = std::max<int64_t>(256, bytes / threads / 256 * 256);
  uint8_t* buf = static_cast<uint8_t*>(std::aligned_alloc(64, per * threads));
  TORCH_CHECK(buf != nullptr, "ygg::read_bandwidth: cannot allocate ", per * threads, " bytes");
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {  // each thread touches its own share first
    for (int64_t t = b; t < e; ++t) std::memset(buf + t * per, 1, per);
  });
  double best = 0.0;
  for (int64_t r = 0; r < repeats; ++r) {
    std::vector<int64_t> sums(threads, 0);
    const double t0 = now();
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      typedef int32_t v16 __attribute__((vector_size(64)));
      for (int64_t t = b; t < e; ++t) {
        const uint8_t* p = buf + t * per;
        v16 s0{}, s1{}, s2{}, s3{};
        for (int64_t i = 0; i < per; i += 256) {  // every byte, 256 a round in four independent sums
          v16 x0, x1, x2, x3;
          std::memcpy(&x0, p + i, 64);
          std::memcpy(&x1, p + i + 64, 64);
          std::memcpy(&x2, p + i + 128, 64);
          std::memcpy(&x3, p + i + 192, 64);
          s0 += x0, s1 += x1, s2 += x2, s3 += x3;
        }
        const v16 s = s0 + s1 + s2 + s3;
        sums[t] = s[0] + s[15];
      }
    });
    const double dt = now() - t0;
    best = std::max(best, per * threads / dt);
  }
  std::free(buf);
  return best;
}

// A copy of `t` in memory the kernel asks Linux to back with 2 MiB pages (transparent huge pages,
// where the system allows them on request): a forward streams its weights once, and with 4 KiB
// pages a gigabyte is 262 144 pages whose translations miss the TLB (measured: the same streaming
// read ~10 % faster on huge pages). Elsewhere, or for small tensors, a plain copy.
at::Tensor huge_copy(const at::Tensor& t) {
  constexpr int64_t HUGE = int64_t{1} << 21;
  const at::Tensor src = t.contiguous();
  const int64_t nbytes = src.numel() * src.element_size();
#ifdef __linux__
  if (src.device().is_cpu() && nbytes >= HUGE) {
    // fresh pages from mmap (malloc may hand back heap pages already faulted in small), the
    // mapping over-allocated by a huge page so that the data can start on a 2 MiB boundary
    const size_t size = (nbytes + 2 * HUGE - 1) / HUGE * HUGE;
    void* map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(map != MAP_FAILED, "ygg::huge_copy: cannot map ", size, " bytes");
    uint8_t* p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(map) + HUGE - 1) / HUGE * HUGE);
    madvise(p, nbytes, MADV_HUGEPAGE);  // a request: where it is refused, ordinary pages
    std::memcpy(p, src.const_data_ptr(), nbytes);
    return at::from_blob(p, src.sizes(), [map, size](void*) { munmap(map, size); }, src.options());
  }
#endif
  return src.clone();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ygg, m) {
  m.def("huge_copy(Tensor t) -> Tensor", &huge_copy);
  m.def("int8_peak(float seconds=0.2, int repeats=5) -> float", &int8_peak);
  m.def("read_bandwidth(int bytes=2147483648, int repeats=5) -> float", &read_bandwidth);
}
