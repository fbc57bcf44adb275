// AVX512 row kernels of the element-wise stages (see elementwise.h). Compiled for the baseline ISA
// with per-function target attributes; called only after runtime CPU detection.
#include "elementwise.h"

#include "moe_common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define CAM_JIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace cam_jit_cpu {
namespace avx512 {
namespace {

CAM_JIT_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

CAM_JIT_AVX512 inline __m512 abs_ps(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
}

// Running max|v| over lanes plus a NaN flag; the caller folds the lanes.
struct MaxAcc {
  __m512 max;
  __mmask16 nan;
};

CAM_JIT_AVX512 inline void max_step(MaxAcc& acc, __m512 v, __mmask16 lanes) {
  const __m512 a = abs_ps(v);
  acc.nan |= _mm512_mask_cmp_ps_mask(lanes, a, a, _CMP_UNORD_Q);
  acc.max = _mm512_mask_max_ps(acc.max, lanes, acc.max, a);
}

// max of non-NaN values is exact and order-free; with a NaN the scalar fold decides.
CAM_JIT_AVX512 inline float finish_max(const MaxAcc& acc, const float* v, int64_t n) {
  if (acc.nan) {
    float m = 0.f;
    for (int64_t j = 0; j < n; ++j) m = cam_jit_cpu::abs_max(m, v[j]);
    return m;
  }
  return _mm512_reduce_max_ps(acc.max);
}

CAM_JIT_AVX512 inline __m512 load_bf16(const uint16_t* x, __mmask16 lanes) {
  const __m256i raw = _mm256_maskz_loadu_epi16(lanes, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// (f32(acc) * s) * a on the lanes.
CAM_JIT_AVX512 inline __m512 w8a8_lanes(const int32_t* acc, const float* s, __m512 a, __mmask16 lanes) {
  const __m512 c = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, acc));
  return _mm512_mul_ps(_mm512_mul_ps(c, _mm512_maskz_loadu_ps(lanes, s)), a);
}

// ((((f32(hi) * s) * 16) + f32(lo) * s) + bias) * a on the lanes.
CAM_JIT_AVX512 inline __m512 w4a8_lanes(const int32_t* hi, const int32_t* lo, const float* s, const float* bias,
                                        __m512 a, __mmask16 lanes) {
  const __m512 sj = _mm512_maskz_loadu_ps(lanes, s);
  const __m512 high =
      _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, hi)), sj), _mm512_set1_ps(16.f));
  const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(lanes, lo)), sj);
  return _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(high, low), _mm512_maskz_loadu_ps(lanes, bias)), a);
}

// bf16(f) with c10's rounding (RNE, NaN -> 0x7FC0), 16 values.
CAM_JIT_AVX512 inline __m256i to_bf16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// bf16(f) into the lanes of y.
CAM_JIT_AVX512 inline void store_bf16(__m512 f, uint16_t* y, __mmask16 lanes) {
  _mm256_mask_storeu_epi16(y, lanes, to_bf16(f));
}

// Where the bf16 dequantisations may write past the caches: whole vectors (n a multiple of 16) at
// 32-byte aligned addresses in every row.
bool streamable(const uint16_t* y, int64_t ld_y, int64_t n) {
  return n % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 32 == 0 && (ld_y * 2) % 32 == 0;
}

}  // namespace

CAM_JIT_AVX512 float abs_max(const float* v, int64_t n) {
  MaxAcc acc{_mm512_setzero_ps(), 0};
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = tail_mask(n - j);
    max_step(acc, _mm512_maskz_loadu_ps(lanes, v + j), lanes);
  }
  return finish_max(acc, v, n);
}

CAM_JIT_AVX512 void bf16_to_float(const uint16_t* x, const float* smooth, float* v, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = tail_mask(n - j);
    __m512 f = load_bf16(x + j, lanes);
    if (smooth != nullptr) f = _mm512_mul_ps(f, _mm512_maskz_loadu_ps(lanes, smooth + j));
    _mm512_mask_storeu_ps(v + j, lanes, f);
  }
}

// round_to_int8: nearbyint, NaN -> 0, clamp to [-127, 127].
CAM_JIT_AVX512 void quantize(const float* v, float pre, float s, int8_t* q, int64_t n, const float* ahead) {
  const __m512 vs = _mm512_set1_ps(s), vpre = _mm512_set1_ps(pre);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t j = 0; j < n; j += 16) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + j), _MM_HINT_T0);
    const __mmask16 lanes = tail_mask(n - j);
    __m512 x = _mm512_maskz_loadu_ps(lanes, v + j);
    if (pre != 0.f) x = _mm512_mul_ps(x, vpre);
    x = _mm512_mul_ps(x, vs);
    __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 number = _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q);
    r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    const __m512i i = _mm512_maskz_cvttps_epi32(number, r);
    _mm_mask_storeu_epi8(q + j, lanes, _mm512_cvtepi32_epi8(i));
  }
}

namespace {

// Row r, columns j..j+15 (the lanes) of a W8A8 or W4A8 dequantisation with row scales a.
struct W8A8Rows {
  const int32_t* acc;
  int64_t ld_acc;
  const float* s;
  const float* a;
  CAM_JIT_AVX512 __m512 operator()(int64_t r, int64_t j, __mmask16 lanes) const {
    return w8a8_lanes(acc + r * ld_acc + j, s + j, _mm512_set1_ps(a[r]), lanes);
  }
};
struct W4A8Rows {
  const int32_t* hi;
  const int32_t* lo;
  int64_t ld_acc;
  const float* s;
  const float* bias;
  const float* a;
  CAM_JIT_AVX512 __m512 operator()(int64_t r, int64_t j, __mmask16 lanes) const {
    return w4a8_lanes(hi + r * ld_acc + j, lo + r * ld_acc + j, s + j, bias + j, _mm512_set1_ps(a[r]), lanes);
  }
};

// d[r * ld_d + j] = value(r, j) over `rows` rows of n.
template <typename Value>
CAM_JIT_AVX512 void store_rows(const Value& value, int64_t rows, float* d, int64_t ld_d, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = tail_mask(n - j);
      _mm512_mask_storeu_ps(d + r * ld_d + j, lanes, value(r, j, lanes));
    }
  }
}

// y[r * ld_y + j] = bf16(value(r, j)) over `rows` rows of n; with `stream` past the caches where
// streamable, fenced before returning.
template <typename Value>
CAM_JIT_AVX512 void store_rows_bf16(const Value& value, int64_t rows, uint16_t* y, int64_t ld_y, int64_t n,
                                    bool stream) {
  if (stream && streamable(y, ld_y, n)) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < n; j += 16) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(y + r * ld_y + j), to_bf16(value(r, j, 0xFFFF)));
      }
    }
    _mm_sfence();
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = tail_mask(n - j);
      store_bf16(value(r, j, lanes), y + r * ld_y + j, lanes);
    }
  }
}

}  // namespace

CAM_JIT_AVX512 void dequant_w8a8(const int32_t* acc, int64_t ld_acc, const float* s, const float* a, int64_t rows,
                                 float* d, int64_t ld_d, int64_t n) {
  store_rows(W8A8Rows{acc, ld_acc, s, a}, rows, d, ld_d, n);
}

CAM_JIT_AVX512 void dequant_w8a8_bf16(const int32_t* acc, int64_t ld_acc, const float* s, const float* a,
                                      int64_t rows, uint16_t* y, int64_t ld_y, int64_t n, bool stream) {
  store_rows_bf16(W8A8Rows{acc, ld_acc, s, a}, rows, y, ld_y, n, stream);
}

CAM_JIT_AVX512 void dequant_w4a8(const int32_t* hi, const int32_t* lo, int64_t ld_acc, const float* s, const float* bias,
                                 const float* a, int64_t rows, float* d, int64_t ld_d, int64_t n) {
  store_rows(W4A8Rows{hi, lo, ld_acc, s, bias, a}, rows, d, ld_d, n);
}

CAM_JIT_AVX512 void dequant_w4a8_bf16(const int32_t* hi, const int32_t* lo, int64_t ld_acc, const float* s,
                                      const float* bias, const float* a, int64_t rows, uint16_t* y, int64_t ld_y,
                                      int64_t n, bool stream) {
  store_rows_bf16(W4A8Rows{hi, lo, ld_acc, s, bias, a}, rows, y, ld_y, n, stream);
}

CAM_JIT_AVX512 void negate(const float* v, float* out, int64_t n) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = tail_mask(n - j);
    const __m512i x = _mm512_castps_si512(_mm512_maskz_loadu_ps(lanes, v + j));
    _mm512_mask_storeu_ps(out + j, lanes, _mm512_castsi512_ps(_mm512_xor_si512(x, sign)));
  }
}

CAM_JIT_AVX512 void swiglu(const float* gate, const float* up, const float* u, int64_t ld_in, int64_t rows, float* h,
                           int64_t ld_h, float* m, int64_t ld_m, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g_row = gate + r * ld_in;
    const float* up_row = up + r * ld_in;
    const float* u_row = u + r * ld_in;
    float* h_row = h + r * ld_h;
    MaxAcc acc{_mm512_setzero_ps(), 0};
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = tail_mask(n - j);
      const __m512 denom = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, u_row + j), one);
      const __m512 g = _mm512_div_ps(_mm512_maskz_loadu_ps(lanes, g_row + j), denom);
      const __m512 hv = _mm512_mul_ps(g, _mm512_maskz_loadu_ps(lanes, up_row + j));
      _mm512_mask_storeu_ps(h_row + j, lanes, hv);
      max_step(acc, hv, lanes);
    }
    m[r * ld_m] = finish_max(acc, h_row, n);
  }
}

CAM_JIT_AVX512 void float_to_bf16(const float* v, uint16_t* y, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = tail_mask(n - j);
    store_bf16(_mm512_maskz_loadu_ps(lanes, v + j), y + j, lanes);
  }
}

// 64 columns at a time in registers: the rows stream side by side and no float row goes through
// memory.
CAM_JIT_AVX512 void combine_bf16(const uint16_t* const* rows, const float* w, int64_t count,
                                 const uint16_t* const* next_rows, int64_t next_count, uint16_t* out, int64_t n) {
  constexpr int kVectors = 4;
  for (int64_t j0 = 0; j0 < n; j0 += 16 * kVectors) {
    for (int64_t k = 0; k < next_count; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(next_rows[k] + j0), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next_rows[k] + j0 + 32), _MM_HINT_T0);
    }
    __m512 acc[kVectors];
    __mmask16 lanes[kVectors];
    for (int v = 0; v < kVectors; ++v) {
      acc[v] = _mm512_setzero_ps();
      lanes[v] = j0 + 16 * v < n ? tail_mask(n - j0 - 16 * v) : 0;
    }
    for (int64_t k = 0; k < count; ++k) {
      const __m512 vw = _mm512_set1_ps(w[k]);
      for (int v = 0; v < kVectors; ++v) {
        acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(load_bf16(rows[k] + j0 + 16 * v, lanes[v]), vw));
      }
    }
    for (int v = 0; v < kVectors; ++v) store_bf16(acc[v], out + j0 + 16 * v, lanes[v]);
  }
}

}  // namespace avx512
}  // namespace cam_jit_cpu
#endif  // __x86_64__
