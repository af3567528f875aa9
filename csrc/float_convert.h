// fp32 <-> bf16/fp16 conversions shared by the CPU kernels (ops/cpu_kernels.cpp, shm/reduce.cpp): bit-exact with
// c10::BFloat16 / c10::Half (round to nearest even) and fast, with the CPU features picked at run time.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fastpar {

#if defined(__x86_64__)
inline bool cpu_supports_f16c() {
  __builtin_cpu_init();  // needed when called from a static initialiser
  return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}
inline bool cpu_supports_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}
inline const bool kHasF16C = cpu_supports_f16c();
// AVX2 clones are chosen at run time (the build targets the baseline ISA). No "fma" in any target: no contraction.
inline const bool kHasAVX2 = cpu_supports_avx2();

// fp16 <-> fp32 with the F16C instructions: c10::Half's portable scalar code does not vectorise (measured 2.3 GB/s
// against 8.9 GB/s for torch's own cast). Both round to nearest even, so results match (NaN payloads aside).
__attribute__((target("avx,f16c"))) inline void half_to_float_f16c(const c10::Half* src, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) out[i] = _cvtsh_ss(src[i].x);
}

__attribute__((target("avx,f16c"))) inline void float_to_half_f16c(const float* in, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = c10::Half(_cvtss_sh(in[i], _MM_FROUND_TO_NEAREST_INT), c10::Half::from_bits());
}
#else
inline const bool kHasF16C = false;
inline const bool kHasAVX2 = false;
inline void half_to_float_f16c(const c10::Half*, float*, int64_t) {}
inline void float_to_half_f16c(const float*, c10::Half*, int64_t) {}
#endif

// Whole arrays, with F16C when present, else c10::Half's scalar conversion.
inline void half_to_float(const c10::Half* src, float* out, int64_t n) {
  if (kHasF16C) return half_to_float_f16c(src, out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
}

inline void float_to_half(const float* in, c10::Half* dst, int64_t n) {
  if (kHasF16C) return float_to_half_f16c(in, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(in[i]);
}

// bf16 <-> fp32 on the bit patterns: widening is a 16-bit shift, narrowing is c10::BFloat16's round-to-nearest-even
// (NaN -> quiet NaN 0x7FC0). Written with integer ops and a select so GCC vectorises them, unlike c10::BFloat16's
// per-element conversion (measured ~3x slower than torch's own cast).
inline __attribute__((always_inline)) float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline __attribute__((always_inline)) uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// Element access by storage type: fp32 as float, bf16 as its raw uint16_t bits.
inline __attribute__((always_inline)) float load_float(const float* p) { return *p; }
inline __attribute__((always_inline)) float load_float(const uint16_t* p) { return bf16_to_float(*p); }
inline __attribute__((always_inline)) void store_float(float* p, float value) { *p = value; }
inline __attribute__((always_inline)) void store_float(uint16_t* p, float value) { *p = float_to_bf16(value); }

template <typename T>
using Storage = std::conditional_t<std::is_same_v<T, c10::BFloat16>, uint16_t, T>;

}  // namespace fastpar
