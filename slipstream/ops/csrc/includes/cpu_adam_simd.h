// Vector abstraction for the cpu_adam kernel: one struct `Vec` per instruction set, chosen at compile time.
//
// Selection: the builder passes one of -D__AVX512__ / -D__AVX256__ / -D__NEON__ / -D__SCALAR__ together with
// -march=native (x86) or -mcpu=native (arm). Without any of them the compiler's own macros decide
// (__AVX512F__, __AVX2__, __ARM_NEON). If a requested level is not enabled in the compiler (for example
// -D__AVX512__ without -mavx512f) the best level the compiler can emit is used instead, so the module always
// builds; simd_level() reports what was compiled.
//
// Every Vec provides: W (floats per register), load/store of fp32, loadu of bf16 widened to fp32, stores of fp32
// narrowed to bf16 (round to nearest even, NaN -> 0x7FC0, bit-identical to c10::BFloat16) and to fp16 (round
// to nearest even), and add/sub/mul/fma/sqrt/div. The kernel adds a scalar tail for lengths that are not a
// multiple of W.
#pragma once

#include <cstdint>

#if defined(__SCALAR__)
#define SLIPSTREAM_SIMD_SCALAR 1
#elif defined(__AVX256__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLIPSTREAM_SIMD_AVX2 1
#elif defined(__NEON__) && defined(__ARM_NEON) && defined(__aarch64__)
#define SLIPSTREAM_SIMD_NEON 1
#elif defined(__AVX512F__)
#define SLIPSTREAM_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLIPSTREAM_SIMD_AVX2 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define SLIPSTREAM_SIMD_NEON 1
#else
#define SLIPSTREAM_SIMD_SCALAR 1
#endif

#if defined(SLIPSTREAM_SIMD_AVX512) || defined(SLIPSTREAM_SIMD_AVX2)
#include <immintrin.h>
#elif defined(SLIPSTREAM_SIMD_NEON)
#include <arm_neon.h>
#endif

namespace slipstream_simd {

// Software prefetch into all cache levels; a no-op where the compiler has no builtin for it.
inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

#if defined(SLIPSTREAM_SIMD_AVX512) || defined(SLIPSTREAM_SIMD_AVX2)
// The members the x86 levels share, written once: they differ only in the intrinsics' prefix P (_mm512,
// _mm256) and register width BITS (512, 256), the integer register I of W lanes (__m512i, __m256i), and the
// register H that holds W halves (__m256i, __m128i) with its unaligned load and store and its streaming store.
// The fp32 register T and its width W follow from BITS. Each Vec defines to_fp16 and to_bf16 (from
// bf16_rounded) itself. Streaming stores need p aligned to kNtAlign bytes and are followed by nt_fence().
#define SLIPSTREAM_X86_VEC_MEMBERS(P, BITS, I, H, LOADU_H, STOREU_H, STREAM_H)                    \
  using T = __m##BITS;                                                                            \
  static constexpr int W = BITS / 32;                                                             \
  static inline T load(const float* p) { return P##_loadu_ps(p); }                                \
  static inline T load_bf16(const uint16_t* p) {                                                  \
    I widened = P##_cvtepu16_epi32(LOADU_H(reinterpret_cast<const H*>(p)));                       \
    return P##_castsi##BITS##_ps(P##_slli_epi32(widened, 16));                                    \
  }                                                                                               \
  /* The upper 16 bits of each lane hold x rounded to the nearest bf16, ties to even (NaN not handled). */ \
  static inline I bf16_rounded(T x) {                                                             \
    I b = P##_castps_si##BITS(x);                                                                 \
    I lsb = P##_and_si##BITS(P##_srli_epi32(b, 16), P##_set1_epi32(1));                           \
    return P##_srli_epi32(P##_add_epi32(b, P##_add_epi32(lsb, P##_set1_epi32(0x7FFF))), 16);      \
  }                                                                                               \
  static inline void store(float* p, T x) { P##_storeu_ps(p, x); }                                \
  static inline void store_bf16(uint16_t* p, T x) { STOREU_H(reinterpret_cast<H*>(p), to_bf16(x)); } \
  static inline void store_fp16(uint16_t* p, T x) { STOREU_H(reinterpret_cast<H*>(p), to_fp16(x)); } \
  static constexpr uintptr_t kNtAlign = sizeof(H);                                                 \
  static inline void stream_bf16(uint16_t* p, T x) { STREAM_H(reinterpret_cast<H*>(p), to_bf16(x)); } \
  static inline void stream_fp16(uint16_t* p, T x) { STREAM_H(reinterpret_cast<H*>(p), to_fp16(x)); } \
  static inline void nt_fence() { _mm_sfence(); }                                                 \
  static inline T set1(float x) { return P##_set1_ps(x); }                                        \
  static inline T add(T a, T b) { return P##_add_ps(a, b); }                                      \
  static inline T sub(T a, T b) { return P##_sub_ps(a, b); }                                      \
  static inline T mul(T a, T b) { return P##_mul_ps(a, b); }                                      \
  static inline T fma(T a, T b, T c) { return P##_fmadd_ps(a, b, c); } /* a*b+c */                \
  static inline T sqrt(T a) { return P##_sqrt_ps(a); }                                            \
  static inline T div(T a, T b) { return P##_div_ps(a, b); }
#endif

#if defined(SLIPSTREAM_SIMD_AVX512)
constexpr const char* kLevel = "avx512";
struct Vec {
  SLIPSTREAM_X86_VEC_MEMBERS(_mm512, 512, __m512i, __m256i, _mm256_loadu_si256, _mm256_storeu_si256,
                             _mm256_stream_si256)
  static inline __m256i to_fp16(T x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline __m256i to_bf16(T x) {
    __m512i r = bf16_rounded(x);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
};
#elif defined(SLIPSTREAM_SIMD_AVX2)
constexpr const char* kLevel = "avx2";
struct Vec {
  SLIPSTREAM_X86_VEC_MEMBERS(_mm256, 256, __m256i, __m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_stream_si128)
  static inline __m128i to_fp16(T x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static inline __m128i to_bf16(T x) {
    __m256i r = bf16_rounded(x);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather quadwords 0 and 2.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
};
#elif defined(SLIPSTREAM_SIMD_NEON)
constexpr const char* kLevel = "neon";
struct Vec {
  using T = float32x4_t;
  static constexpr int W = 4;
  static inline T load(const float* p) { return vld1q_f32(p); }
  static inline void store(float* p, T x) { vst1q_f32(p, x); }
  static inline T load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
  static inline void store_bf16(uint16_t* p, T x) {
    uint32x4_t b = vreinterpretq_u32_f32(x);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1));
    uint16x4_t h = vshrn_n_u32(vaddq_u32(b, vaddq_u32(lsb, vdupq_n_u32(0x7FFF))), 16);
    uint16x4_t is_num = vmovn_u32(vceqq_f32(x, x));
    vst1_u16(p, vbsl_u16(is_num, h, vdup_n_u16(0x7FC0)));
  }
  static inline void store_fp16(uint16_t* p, T x) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
  static constexpr uintptr_t kNtAlign = 8;  // no streaming store on NEON: plain stores
  static inline void stream_bf16(uint16_t* p, T x) { store_bf16(p, x); }
  static inline void stream_fp16(uint16_t* p, T x) { store_fp16(p, x); }
  static inline void nt_fence() {}
  static inline T set1(float x) { return vdupq_n_f32(x); }
  static inline T add(T a, T b) { return vaddq_f32(a, b); }
  static inline T sub(T a, T b) { return vsubq_f32(a, b); }
  static inline T mul(T a, T b) { return vmulq_f32(a, b); }
  static inline T fma(T a, T b, T c) { return vfmaq_f32(c, a, b); }
  static inline T sqrt(T a) { return vsqrtq_f32(a); }
  static inline T div(T a, T b) { return vdivq_f32(a, b); }
};
#else
constexpr const char* kLevel = "scalar";
#endif

}  // namespace slipstream_simd
