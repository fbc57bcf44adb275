// AVX512 row kernels of the element-wise stages (VectorKernel::kAvx512), bit-identical to the scalar
// loops they replace: the same IEEE float32 operations in the same order per element (no FMA), the
// same round-half-even, bf16 casts with c10's rounding and NaN, and a max|v| that falls back to the
// scalar NaN-propagating fold when a row holds a NaN. Only for x86-64 builds; callers check
// vector_kernel() first. bf16 values travel as their uint16_t bits.
#pragma once

#include <cstdint>

namespace cam_jit_cpu {
namespace avx512 {

// The scalar fold `m = abs_max(m, v[j])` from m = 0 over the row.
float abs_max(const float* v, int64_t n);
// v[j] = f32(x[j]) (smooth == nullptr) or f32(x[j]) * smooth[j].
void bf16_to_float(const uint16_t* x, const float* smooth, float* v, int64_t n);
// q[j] = round_to_int8(v[j] * s) (pre == 0), or round_to_int8((v[j] * pre) * s). ahead: n floats the
// caller reads next, prefetched a line per 16 values (or nullptr).
void quantize(const float* v, float pre, float s, int8_t* q, int64_t n, const float* ahead = nullptr);
// The dequantisations below run over `rows` rows of n values: row r of the int32 products at
// r * ld_acc, row r of the output at r * ld_d (ld_y), a[r] the row's scale.
// d[j] = (f32(acc[j]) * s[j]) * a.
void dequant_w8a8(const int32_t* acc, int64_t ld_acc, const float* s, const float* a, int64_t rows, float* d,
                  int64_t ld_d, int64_t n);
// d[j] = ((((f32(hi[j]) * s[j]) * 16) + f32(lo[j]) * s[j]) + bias[j]) * a.
void dequant_w4a8(const int32_t* hi, const int32_t* lo, int64_t ld_acc, const float* s, const float* bias,
                  const float* a, int64_t rows, float* d, int64_t ld_d, int64_t n);
// y[j] = bf16 of dequant_w8a8's d[j] / dequant_w4a8's d[j] (float_to_bf16's rounding); with `stream`,
// written past the caches (non-temporal stores, fenced before returning) where n is a multiple of
// 16 and every row starts 32-byte aligned.
void dequant_w8a8_bf16(const int32_t* acc, int64_t ld_acc, const float* s, const float* a, int64_t rows, uint16_t* y,
                       int64_t ld_y, int64_t n, bool stream);
void dequant_w4a8_bf16(const int32_t* hi, const int32_t* lo, int64_t ld_acc, const float* s, const float* bias,
                       const float* a, int64_t rows, uint16_t* y, int64_t ld_y, int64_t n, bool stream);
// out[j] = -v[j].
void negate(const float* v, float* out, int64_t n);
// Over `rows` rows of n values (gate, up and u row r at r * ld_in, h row r at r * ld_h):
// h[j] = (gate[j] / (u[j] + 1)) * up[j], and m[r * ld_m] the abs_max fold of h's row r.
void swiglu(const float* gate, const float* up, const float* u, int64_t ld_in, int64_t rows, float* h, int64_t ld_h,
            float* m, int64_t ld_m, int64_t n);
// y[j] = bf16(v[j]) (c10 rounding: RNE, NaN -> 0x7FC0).
void float_to_bf16(const float* v, uint16_t* y, int64_t n);
// out[j] = bf16((((0 + f32(rows[0][j]) * w[0]) + f32(rows[1][j]) * w[1]) + ...) over `count` rows, each
// product and sum rounded (float_to_bf16's rounding of the sum). The `next_count` rows next_rows (n
// values each, the caller's next token) are prefetched meanwhile.
void combine_bf16(const uint16_t* const* rows, const float* w, int64_t count, const uint16_t* const* next_rows,
                  int64_t next_count, uint16_t* out, int64_t n);

}  // namespace avx512
}  // namespace cam_jit_cpu
