// Expert-side kernels of fused_deep_moe on CPU: per local expert, integer GEMM1, dequant + SwiGLU
// + requant, integer GEMM2, dequant (docs/semantics.md §1.8 steps 2-4; W4A8: §1.9). The integer GEMMs are
// exact int8 x int8 -> int32: the prepacked VNNI / AMX kernels of int8_gemm.cpp, or ATen's `_int_mm`
// (the portable variant, which for W4A8 unpacks each expert's int4 weights to int8 on every call
// and multiplies the high and low nibbles of the activations, stacked into one GEMM, by them). The
// epilogues are fused loops threaded with at::parallel_for.
#include "elementwise.h"
#include "exp_direct.h"
#include "expert_ffn.h"
#include "int8_gemm.h"
#include "moe_common.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <type_traits>
#include <vector>

namespace cam_jit_cpu {
namespace {

int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// A float32 vector (scale or bias) of one local expert: read in place when the container holds it
// as float32 with unit stride, else widened exactly into `owner`.
struct ExpertVector {
  at::Tensor owner;
  const float* data = nullptr;
  int64_t numel = 0;
};

ExpertVector float_item(at::TensorList container, int64_t e) {
  const ExpertSlot slot = expert_slot(container, e, 1);
  const at::Tensor& of = slot.of;
  check_cpu(of, "weight scale or bias");
  if (of.scalar_type() == at::kFloat) {
    if (slot.e >= 0 && (of.size(1) <= 1 || of.stride(1) == 1)) {
      return {at::Tensor(), of.data_ptr<float>() + slot.e * of.stride(0), of.size(1)};
    }
    if (slot.e < 0 && of.is_contiguous()) return {at::Tensor(), of.data_ptr<float>(), of.numel()};
  }
  ExpertVector v;
  v.owner = expert_item(container, e, 1).to(at::kFloat).contiguous();
  v.data = v.owner.data_ptr<float>();
  v.numel = v.owner.numel();
  return v;
}

// W8A8 dequantisation before the per-token scale (§1.8 steps 2.2-2.3, 4.2): f32(acc) * s.
// Rows of `width` accumulators `ld` apart.
struct W8A8Dequant {
  const int32_t* acc;
  const float* s;
  int64_t width, ld;
  float operator()(int64_t r, int64_t j) const { return static_cast<float>(acc[r * ld + j]) * s[j]; }
#if defined(__x86_64__)
  // out[i * ld_out + j] = (*this)(r0 + i, j) * scales[i] for `rows` whole rows, AVX512.
  void rows_avx512(int64_t r0, int64_t rows, const float* scales, float* out, int64_t ld_out) const {
    avx512::dequant_w8a8(acc + r0 * ld, ld, s, scales, rows, out, ld_out, width);
  }
  // The same rows cast to bf16 (bits); `stream`: past the caches where the rows allow.
  void rows_bf16_avx512(int64_t r0, int64_t rows, const float* scales, uint16_t* out, int64_t ld_out,
                        bool stream) const {
    avx512::dequant_w8a8_bf16(acc + r0 * ld, ld, s, scales, rows, out, ld_out, width, stream);
  }
#endif
};

// W4A8 dequantisation before the per-token scale (§1.9 item 4):
// ((f32(c_hi) * s) * 16 + f32(c_lo) * s) + bias, c_hi / c_lo the GEMMs of the high / low nibbles.
struct W4A8Dequant {
  const int32_t* hi;
  const int32_t* lo;
  const float* s;
  const float* bias;
  int64_t width, ld;
  float operator()(int64_t r, int64_t j) const {
    const float high = (static_cast<float>(hi[r * ld + j]) * s[j]) * 16.f;
    const float low = static_cast<float>(lo[r * ld + j]) * s[j];
    return (high + low) + bias[j];
  }
#if defined(__x86_64__)
  void rows_avx512(int64_t r0, int64_t rows, const float* scales, float* out, int64_t ld_out) const {
    avx512::dequant_w4a8(hi + r0 * ld, lo + r0 * ld, ld, s, bias, scales, rows, out, ld_out, width);
  }
  void rows_bf16_avx512(int64_t r0, int64_t rows, const float* scales, uint16_t* out, int64_t ld_out,
                        bool stream) const {
    avx512::dequant_w4a8_bf16(hi + r0 * ld, lo + r0 * ld, ld, s, bias, scales, rows, out, ld_out, width, stream);
  }
#endif
};

// out[i * ld_out + j] = dequant(r0 + i, j) * scales[i] over `rows` whole rows (steps 2.2-2.4, 4.2 before
// the cast).
template <typename Dequant>
void dequant_rows(const Dequant& dequant, int64_t r0, int64_t rows, const float* scales, float* out, int64_t ld_out,
                  bool vec) {
#if defined(__x86_64__)
  if (vec) return dequant.rows_avx512(r0, rows, scales, out, ld_out);
#endif
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < dequant.width; ++j) out[i * ld_out + j] = dequant(r0 + i, j) * scales[i];
  }
}

// out[j] = -v[j].
void negate_row(const float* v, float* out, int64_t n, bool vec) {
#if defined(__x86_64__)
  if (vec) return avx512::negate(v, out, n);
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = -v[j];
}

// out[j] = cast(v[j]) (RNE).
template <typename scalar_t>
void cast_row(const float* v, scalar_t* out, int64_t n, bool vec) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (vec) return avx512::float_to_bf16(v, reinterpret_cast<uint16_t*>(out), n);
  }
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<scalar_t>(v[j]);
}

// out[i * ld_out + j] = cast(dequant(r0 + i, j) * scales[i]) over `rows` whole rows (step 4.2); for
// bf16 under the AVX512 variant without a float row in between (with `stream`, past the caches),
// else through `row` (scratch of dequant.width floats).
template <typename scalar_t, typename Dequant>
void dequant_cast_rows(const Dequant& dequant, int64_t r0, int64_t rows, const float* scales, scalar_t* out,
                       int64_t ld_out, float* row, bool vec, bool stream) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (vec) return dequant.rows_bf16_avx512(r0, rows, scales, reinterpret_cast<uint16_t*>(out), ld_out, stream);
  }
#endif
  for (int64_t i = 0; i < rows; ++i) {
    dequant_rows(dequant, r0 + i, 1, scales + i, row, 0, vec);
    cast_row(row, out + i * ld_out, dequant.width, vec);
  }
}

// Step 2.4: d[r, j] = dequant(r, j) * a[r]. Also writes -d of the gate half into neg_gate so that
// exp can run over one contiguous block with ATen's vectorised kernel.
template <typename Dequant>
void dequant_gmm1(const Dequant& dequant, const float* a, at::Tensor& d, at::Tensor& neg_gate) {
  const int64_t rows = d.size(0);
  const int64_t width = d.size(1);
  const int64_t inter = width / 2;
  float* d_ptr = d.data_ptr<float>();
  float* ng_ptr = neg_gate.data_ptr<float>();
  const bool vec = vector_kernel() == VectorKernel::kAvx512;
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    dequant_rows(dequant, begin, end - begin, a + begin, d_ptr + begin * width, width, vec);
    for (int64_t r = begin; r < end; ++r) negate_row(d_ptr + r * width, ng_ptr + r * inter, inter, vec);
  });
}

// Steps 2.5 (after exp) to 3.2 on `rows` rows of n values (gate, up and u row i at i * ld_in, h row
// i at i * ld_h): G = gate / (u + 1) with u = exp(-gate), h = G * up, and m[i * ld_m] the abs_max
// fold of h's row i from 0.
void swiglu_rows(const float* gate, const float* up, const float* u, int64_t ld_in, int64_t rows, float* h,
                 int64_t ld_h, float* m, int64_t ld_m, int64_t n, bool vec) {
#if defined(__x86_64__)
  if (vec) return avx512::swiglu(gate, up, u, ld_in, rows, h, ld_h, m, ld_m, n);
#endif
  for (int64_t i = 0; i < rows; ++i) {
    float fold = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float denom = u[i * ld_in + j] + 1.f;
      const float g = gate[i * ld_in + j] / denom;
      h[i * ld_h + j] = g * up[i * ld_in + j];
      fold = abs_max(fold, h[i * ld_h + j]);
    }
    m[i * ld_m] = fold;
  }
}

// Steps 3.3-3.4 on a row h of `inter` values with m its abs_max fold: q = rint((h * 127) * (1 / m));
// returns b = m * (1/127). next_h: the row the caller requantises next (or nullptr), which the AVX512
// variant brings into L1 meanwhile.
float requant_row(const float* h, float m, int8_t* q, int64_t inter, bool vec, const float* next_h = nullptr) {
  const float inv_m = 1.f / m;
  if (std::isinf(inv_m)) {  // m 0 or subnormal, docs/semantics.md §1.11
    std::fill(q, q + inter, int8_t{0});
    return 0.f;
  }
#if defined(__x86_64__)
  if (vec) {
    avx512::quantize(h, 127.f, inv_m, q, inter, next_h);
    return m * (1.f / 127.f);
  }
#endif
  for (int64_t j = 0; j < inter; ++j) {
    const float scaled = h[j] * 127.f;
    q[j] = round_to_int8(scaled * inv_m);
  }
  return m * (1.f / 127.f);
}

// Steps 2.5-3.4 on one row (u = exp(-gate); h: scratch of `inter` floats): the requantised row into
// q, returns its scale b.
float swiglu_requant_row(const float* gate, const float* up, const float* u, float* h, int8_t* q, int64_t inter,
                         bool vec) {
  float m = 0.f;
  swiglu_rows(gate, up, u, 0, 1, h, 0, &m, 0, inter, vec);
  return requant_row(h, m, q, inter, vec);
}

// Steps 2.5-3.4 for every row of d [rows, 2I]; exp_neg [rows, I] holds exp(-d_gate).
void swiglu_requant(const at::Tensor& d, const at::Tensor& exp_neg, at::Tensor& q2, float* b) {
  const int64_t rows = d.size(0);
  const int64_t inter = d.size(1) / 2;
  const float* d_ptr = d.data_ptr<float>();
  const float* u_ptr = exp_neg.data_ptr<float>();
  int8_t* q_ptr = q2.data_ptr<int8_t>();
  const bool vec = vector_kernel() == VectorKernel::kAvx512;
  at::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    std::vector<float> h(inter);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = d_ptr + r * 2 * inter;
      b[r] = swiglu_requant_row(gate, gate + inter, u_ptr + r * inter, h.data(), q_ptr + r * inter, inter, vec);
    }
  });
}

// Step 4.2: y[r, j] = cast(dequant(r, j) * b[r]) into `rows` rows of `out`.
template <typename scalar_t, typename Dequant>
void dequant_gmm2(const Dequant& dequant, int64_t rows, const float* b, scalar_t* out) {
  const int64_t width = dequant.width;
  const bool vec = vector_kernel() == VectorKernel::kAvx512;
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    dequant_cast_rows(dequant, begin, end - begin, b + begin, out + begin * width, width, row.data(), vec, false);
  });
}

// §1.5: int32 [K, M] words -> int8 [K, 8M] int4 values; column 8w + s is nibble s (bits 4s..4s+3,
// nibble 0 least significant) of word w, two's complement. On a little-endian machine byte i of
// the words holds columns 2i (low nibble) and 2i + 1 (high nibble), which a byte loop vectorises.
static_assert(std::endian::native == std::endian::little, "the int4 unpacking reads words byte by byte");
at::Tensor unpack_int4(const at::Tensor& packed) {
  const at::Tensor pc = packed.contiguous();
  at::Tensor out = at::empty({pc.size(0), pc.size(1) * 8}, pc.options().dtype(at::kChar));
  const int8_t* const src_base = reinterpret_cast<const int8_t*>(pc.data_ptr<int32_t>());
  int8_t* const dst_base = out.data_ptr<int8_t>();
  at::parallel_for(0, pc.numel() * 4, 16384, [&](int64_t begin, int64_t end) {
    // Local copies: int8 stores may alias anything, including pointers read through the closure,
    // which would keep the loop from vectorising.
    const int8_t* src = src_base;
    int8_t* dst = dst_base;
    for (int64_t i = begin; i < end; ++i) {
      const int8_t byte = src[i];
      dst[2 * i] = static_cast<int8_t>(static_cast<int8_t>(byte << 4) >> 4);  // sign-extend the low nibble
      dst[2 * i + 1] = static_cast<int8_t>(byte >> 4);  // arithmetic shift: the high nibble
    }
  });
  return out;
}

// §1.9 item 1: int8 q [n, K] -> int8 [2n, K], rows 0..n-1 hi = floor(q / 16) (arithmetic shift),
// rows n..2n-1 lo = (q & 15) - 8, so that q = 16 hi + lo + 8 and one GEMM serves both.
at::Tensor split_nibbles(const at::Tensor& q) {
  const int64_t n = q.size(0);
  const int64_t k = q.size(1);
  at::Tensor out = at::empty({2 * n, k}, q.options());
  const int8_t* const src_base = q.data_ptr<int8_t>();
  int8_t* const out_base = out.data_ptr<int8_t>();
  at::parallel_for(0, n * k, 16384, [&](int64_t begin, int64_t end) {
    const int8_t* src = src_base;  // local copies, as in unpack_int4
    int8_t* hi = out_base;
    int8_t* lo = out_base + n * k;
    for (int64_t i = begin; i < end; ++i) {
      const int32_t v = src[i];
      hi[i] = static_cast<int8_t>(v >> 4);
      lo[i] = static_cast<int8_t>((v & 15) - 8);
    }
  });
  return out;
}

// A 2-D weight matrix of one local expert as stored: `of` itself (e < 0) or its slice e along a
// stacked expert dimension, which the packed path reads without making the view.
struct ExpertMatrix {
  at::Tensor of;
  int64_t e = -1;
  int64_t size(int64_t d) const { return of.size(e < 0 ? d : d + 1); }
  c10::IntArrayRef sizes() const { return e < 0 ? of.sizes() : of.sizes().slice(1); }
  at::Tensor tensor() const { return e < 0 ? of : of.select(0, e); }
  std::shared_ptr<const PackedMatrix> packed(bool int4) const {
    return e < 0 ? packed_matrix(of, int4) : packed_matrix(of, e, int4);
  }
};

// One local expert's weights: int8 (W8A8) or int32 words of packed int4 (W4A8) matrices as stored,
// float32 vectors; the biases are empty under W8A8.
struct Expert {
  ExpertMatrix w1;
  ExpertVector s1, b1;
  ExpertMatrix w2;
  ExpertVector s2, b2;
  bool int4;  // W4A8
};

// acc = q . w exactly with ATen's `_int_mm` (int4 weights: [2 rows, N], the hi then the lo nibbles
// of q).
at::Tensor int_matmul(const at::Tensor& q, const at::Tensor& w, bool int4) {
  return int4 ? at::_int_mm(split_nibbles(q), unpack_int4(w)) : at::_int_mm(q, w.contiguous());
}

// Steps 2.1-2.4 (§1.9 items 1-5 for W4A8): d = dequant(q . W1) * a, and -d of the gate half.
void gmm1_stage(const at::Tensor& q, const float* a, const Expert& ex, at::Tensor& d, at::Tensor& neg_gate) {
  const int64_t rows = q.size(0);
  const int64_t width = d.size(1);
  const float* s = ex.s1.data;
  const at::Tensor acc = int_matmul(q, ex.w1.tensor(), ex.int4);
  if (!ex.int4) {
    dequant_gmm1(W8A8Dequant{acc.data_ptr<int32_t>(), s, width, width}, a, d, neg_gate);
    return;
  }
  const int32_t* hi = acc.data_ptr<int32_t>();
  dequant_gmm1(W4A8Dequant{hi, hi + rows * width, s, ex.b1.data, width, width}, a, d, neg_gate);
}

// Step 4 (§1.9 for W4A8): y = cast(dequant(q2 . W2) * b) into rows of `out`.
template <typename scalar_t>
void gmm2_stage(const at::Tensor& q2, const float* b, const Expert& ex, scalar_t* out) {
  const int64_t rows = q2.size(0);
  const int64_t width = ex.s2.numel;
  const float* s = ex.s2.data;
  const at::Tensor acc = int_matmul(q2, ex.w2.tensor(), ex.int4);
  if (!ex.int4) {
    dequant_gmm2(W8A8Dequant{acc.data_ptr<int32_t>(), s, width, width}, rows, b, out);
    return;
  }
  const int32_t* hi = acc.data_ptr<int32_t>();
  dequant_gmm2(W4A8Dequant{hi, hi + rows * width, s, ex.b2.data, width, width}, rows, b, out);
}

// Steps 2-4 of one expert on its own, each stage threaded over rows or columns (the `_int_mm`
// GEMM). y: the expert's rows of the output.
template <typename scalar_t>
void expert_alone(const at::Tensor& qe, const float* a, const Expert& ex, int64_t inter, scalar_t* y) {
  const int64_t rows = qe.size(0);
  at::Tensor d = at::empty({rows, 2 * inter}, qe.options().dtype(at::kFloat));
  at::Tensor neg_gate = at::empty({rows, inter}, d.options());
  gmm1_stage(qe, a, ex, d, neg_gate);
  at::exp_(neg_gate);
  at::Tensor q2 = at::empty({rows, inter}, qe.options());
  std::vector<float> b(rows);
  swiglu_requant(d, neg_gate, q2, b.data());
  gmm2_stage<scalar_t>(q2, b.data(), ex, y);
}

// Starts fetching the `cols` floats at v (a column group's scales or biases): at decode sizes they
// come from memory, and the epilogue would wait for them after the group's GEMM.
void prefetch_floats(const float* v, int64_t cols) {
  for (int64_t j = 0; j < cols; j += 16) __builtin_prefetch(v + j);
}

// An expert in the grouped path of the packed GEMMs (VNNI or AMX, chosen by its row count): its rows,
// weights and slices of the shared buffers.
struct PackedExpert {
  int64_t start, rows, inter;
  GemmKernel kernel;
  Expert ex;
  std::shared_ptr<const PackedMatrix> w1, w2;
  PackedRows rows1, rows2;
  int64_t d_at, gate_at;  // offsets (floats) of its rows in the two float blocks of experts_packed's stage
};

// The accumulator rows an expert's group needs in the scratch of for_each_group (AMX pads to 16).
int64_t scratch_rows(int64_t rows) { return (rows + 15) / 16 * 16; }

// Column group g of one of an expert's packed GEMMs, multiplied (GroupProduct): its exact products
// in the caller's scratch and the dequantisation of its `cols` columns from column `col` on.
struct GroupProduct {
  int64_t col, cols;
  bool int4;
  W8A8Dequant w8;
  W4A8Dequant w4;
};

// out[r * ld_out + j] = dequantised (r, p.col + j) * scales[r] over the group's columns, r < rows.
void dequant_group_rows(const GroupProduct& p, int64_t rows, const float* scales, float* out, int64_t ld_out,
                        bool vec) {
  if (p.int4) return dequant_rows(p.w4, 0, rows, scales, out, ld_out, vec);
  dequant_rows(p.w8, 0, rows, scales, out, ld_out, vec);
}

// out[r * ld_out + j] = cast(dequantised (r, p.col + j) * scales[r]) over the group's columns, r < rows
// (step 4.2); `stream` as dequant_cast_rows.
template <typename scalar_t>
void dequant_cast_group_rows(const GroupProduct& p, int64_t rows, const float* scales, scalar_t* out, int64_t ld_out,
                             bool vec, bool stream) {
  float row[kVnniGroupColumns];
  if (p.int4) return dequant_cast_rows(p.w4, 0, rows, scales, out, ld_out, row, vec, stream);
  dequant_cast_rows(p.w8, 0, rows, scales, out, ld_out, row, vec, stream);
}

// q . W on column group g of an expert's matrix w of `width` columns, its scales s and (W4A8) biases
// bias: acc (and, for int4, the lo products after scratch_rows(rows) rows of it) of 64 ints per row.
// next: the group this thread runs after it (vnni_group prefetches into it).
GroupProduct group_product(const PackedExpert& pe, const PackedRows& rows, const PackedMatrix& w,
                           const ExpertVector& s, const ExpertVector& bias, int64_t width, int64_t g, VnniNext next,
                           int32_t* acc) {
  const int64_t col = g * kVnniGroupColumns, cols = std::min<int64_t>(kVnniGroupColumns, width - col);
  int32_t* lo = acc + scratch_rows(pe.rows) * kVnniGroupColumns;
  const float* sp = s.data + col;
  const float* bp = pe.ex.int4 ? bias.data + col : nullptr;
  prefetch_floats(sp, cols);
  if (bp != nullptr) prefetch_floats(bp, cols);
  if (pe.kernel == GemmKernel::kAmx) {
    amx_group(rows, w, g, acc, lo, kVnniGroupColumns);
  } else {
    vnni_group(rows, w, g, acc, lo, kVnniGroupColumns, pe.kernel, next);
  }
  return {col, cols, pe.ex.int4, W8A8Dequant{acc, sp, cols, kVnniGroupColumns},
          W4A8Dequant{acc, lo, sp, bp, cols, kVnniGroupColumns}};
}

// Steps 2.2-3.2 on an item of GEMM1 that holds the same 64 columns of both halves: `gate` and `up`
// multiplied for `rows` rows with scales a. h[r * ld_h + j] = SwiGLU of column j of the item, and
// part_max[r * ld_max] the abs_max fold of the row's 64 values of h (folded over the items of the
// row, in order, that is the fold over the whole row: max is exact, and the first NaN wins either
// way). exp runs once over the item's rows (exp_direct); scratch: 3 x rows x 64 floats.
void swiglu_group(const GroupProduct& gate, const GroupProduct& up, int64_t rows, const float* a, float* scratch,
                  float* h, int64_t ld_h, float* part_max, int64_t ld_max, bool vec) {
  constexpr int64_t n = kVnniGroupColumns;
  float* const g = scratch;
  float* const u = g + rows * n;
  float* const p = u + rows * n;
  dequant_group_rows(gate, rows, a, g, n, vec);
  negate_row(g, u, rows * n, vec);
  dequant_group_rows(up, rows, a, p, n, vec);
  exp_direct(u, rows * n);
  swiglu_rows(g, p, u, n, rows, h, ld_h, part_max, ld_max, n, vec);
}

// Items [front, back) of a run of for_each_group still to take, in one word: its owner takes them
// from the front, a thread that has run out of its own from the back.
class ItemRun {
 public:
  void reset(int64_t front, int64_t back) { left_.store(pack(front, back)); }
  // Takes the next item from the front (or the back) into `item`; false once the run is empty.
  bool take(bool from_front, int64_t& item) {
    uint64_t cur = left_.load();
    while (true) {
      const int64_t front = static_cast<int64_t>(cur >> 32), back = static_cast<int64_t>(cur & 0xffffffffu);
      if (front >= back) return false;
      if (left_.compare_exchange_weak(cur, from_front ? pack(front + 1, back) : pack(front, back - 1))) {
        item = from_front ? front : back - 1;
        return true;
      }
    }
  }
  // The item the front would give next, or -1 if none is left.
  int64_t peek_front() const {
    const uint64_t cur = left_.load();
    const int64_t front = static_cast<int64_t>(cur >> 32);
    return front < static_cast<int64_t>(cur & 0xffffffffu) ? front : -1;
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back);
  }
  std::atomic<uint64_t> left_{0};
};

// Runs fn(expert, item, next, scratch) for every item of matrix `which` of every expert in one
// parallel region. An item is `span` of the matrix's 64-column groups: group i alone (span 1), or
// group i of each half of the columns (span 2: groups i and i + groups / 2, which for GEMM1 are the
// same columns of the gate and the up half). Each thread owns a contiguous run of (expert, item)
// pairs of about equal cost (weight bytes streamed, once per 6 rows with VNNI, once per 32 with AMX)
// and runs it in order; a thread done with its own run takes the last items left in the others', so
// that a thread the machine slows (or a cost the estimate misses) does not hold up the region.
// Every item is computed alike on whichever thread runs it. next: the first group of the item the
// thread expects to run after this one (for group_product's prefetch); scratch: a per-thread int32
// buffer of scratch_words x scratch_rows(rows) words.
template <typename Fn>
void for_each_group(const std::vector<PackedExpert>& experts, std::shared_ptr<const PackedMatrix> PackedExpert::*which,
                    int64_t span, int64_t scratch_words, const Fn& fn) {
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, item)
  std::vector<double> until;                          // cumulative cost through each item
  double total = 0;
  int64_t max_rows = 0;
  for (int64_t x = 0; x < static_cast<int64_t>(experts.size()); ++x) {
    const PackedExpert& ve = experts[x];
    const PackedMatrix& w = *(ve.*which);
    const int64_t passes = ve.kernel == GemmKernel::kAmx ? (ve.rows + 31) / 32 : (ve.rows + 5) / 6;
    const double cost = span * (static_cast<double>(w.kp) * (1 + passes) + 64.0 * ve.rows);
    for (int64_t i = 0; i < vnni_groups(w) / span; ++i) {
      items.emplace_back(x, i);
      until.push_back(total += cost);
    }
    max_rows = std::max(max_rows, scratch_rows(ve.rows));
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n_items);
  std::vector<ItemRun> runs(threads);
  for (int64_t t = 0, lo = 0; t < threads; ++t) {
    // items whose cost ends in (total * t / threads, total * (t + 1) / threads]
    const int64_t hi = t + 1 == threads ? n_items
                                        : std::upper_bound(until.begin(), until.end(), total * (t + 1) / threads) -
                                              until.begin();
    runs[t].reset(lo, hi);
    lo = hi;
  }
  const auto item_next = [&](int64_t i) {
    return i >= 0 && i < n_items ? VnniNext{(experts[items[i].first].*which).get(), items[i].second} : VnniNext{};
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    thread_local KeptBuffer scratch_space;
    int32_t* const scratch = scratch_space.get<int32_t>(scratch_words * max_rows);
    for (int64_t t = t0; t < t1; ++t) {
      int64_t i = 0;
      while (runs[t].take(true, i)) {
        fn(experts[items[i].first], items[i].second, item_next(runs[t].peek_front()), scratch);
      }
      for (int64_t other = 1; other < threads; ++other) {
        ItemRun& run = runs[(t + other) % threads];
        while (run.take(false, i)) fn(experts[items[i].first], items[i].second, item_next(i - 1), scratch);
      }
    }
    scratch_space.trim();
  });
}

// Steps 2-4 of every expert in `experts` with its packed GEMM, in parallel regions: GEMM1 of all
// experts with the dequantisation fused per column group, the requantisation (each requantised row
// laid out for GEMM2 as it is made), GEMM2 with the dequantisation and cast fused. SwiGLU runs in
// GEMM1's epilogue when `fused` (every expert's I a multiple of 64, so that an item of GEMM1 holds the
// same columns of both halves, and exp_direct available): then exp runs per item on values in cache,
// only h [rows, I] and its maxima per item are kept, and an expert's rows are requantised in GEMM1's
// region by the thread that finishes its last item (2 % faster at BS 8-256 on an AMD EPYC than a
// region of its own, which read h back from memory). Else the epilogue keeps d [rows, 2I] and -d of
// the gate half, exp runs over all of them at once, and SwiGLU and the requantisation run over
// blocks of rows in a region between the GEMMs. stream_y: GEMM2's epilogue writes y past the caches
// (stream_expert_output).
template <typename scalar_t>
void experts_packed(std::vector<PackedExpert>& experts, const GroupedRows& rows, scalar_t* y, int64_t hidden,
                    bool fused, bool stream_y) {
  const bool vec = vector_kernel() == VectorKernel::kAvx512;
  const float* a = rows.scale;
  // The stage buffer of this call, kept by the calling thread (4-7.5 MiB for a full batch, see
  // ffn_on_rows): per expert its rows of d [rows, 2I] and of -d of the gate half [rows, I], or fused,
  // of h [rows, I] and of h's maxima per item [rows, I / 64]; the row scales b of GEMM2; then the
  // experts' packed activation rows of both GEMMs (64-byte aligned each).
  int64_t d_size = 0, gate_size = 0, h_size = 0;
  for (PackedExpert& ve : experts) {
    ve.d_at = d_size;
    ve.gate_at = gate_size;
    h_size += ve.rows * ve.inter;
    d_size += ve.rows * (fused ? 1 : 2) * ve.inter;
    gate_size += ve.rows * (fused ? ve.inter / kVnniGroupColumns : ve.inter);
    ve.w1 = ve.ex.w1.packed(ve.ex.int4);
    ve.w2 = ve.ex.w2.packed(ve.ex.int4);
  }
  const int64_t gate_at = round_up(d_size * 4, 64), b_at = gate_at + round_up(gate_size * 4, 64);
  int64_t stage_bytes = b_at + round_up(rows.count * 4, 64);
  for (const PackedExpert& ve : experts) {
    stage_bytes += packed_rows_bytes(*ve.w1, ve.rows, ve.kernel) + packed_rows_bytes(*ve.w2, ve.rows, ve.kernel);
  }
  thread_local KeptBuffer stage;
  char* const stage_ptr = stage.get<char>(stage_bytes);
  float* d_ptr = reinterpret_cast<float*>(stage_ptr);
  float* ng_ptr = reinterpret_cast<float*>(stage_ptr + gate_at);
  float* b = reinterpret_cast<float*>(stage_ptr + b_at);
  char* rows_ptr = stage_ptr + b_at + round_up(rows.count * 4, 64);
  for (PackedExpert& ve : experts) {
    ve.rows1 = packed_rows(*ve.w1, ve.rows, ve.kernel, rows_ptr);
    rows_ptr += packed_rows_bytes(*ve.w1, ve.rows, ve.kernel);
    ve.rows2 = packed_rows(*ve.w2, ve.rows, ve.kernel, rows_ptr);  // set by region B
    rows_ptr += packed_rows_bytes(*ve.w2, ve.rows, ve.kernel);
  }
  // GEMM1's activation rows, row k of the batch being row k - before of expert x.
  int64_t count = 0;
  for (const PackedExpert& ve : experts) count += ve.rows;
  at::parallel_for(0, count, std::max<int64_t>(1, 65536 / hidden), [&](int64_t begin, int64_t end) {
    int64_t x = 0, before = 0;
    for (int64_t k = begin; k < end; ++k) {
      while (k >= before + experts[x].rows) before += experts[x++].rows;
      set_row(experts[x].rows1, k - before, rows.row(experts[x].start + k - before));
    }
  });
  if (fused) {
    // Steps 3.2-3.4 of an expert's rows run on the thread that finishes its last item, while h is in
    // cache: the fold of each row's maxima in column order, the requantisation and the row's layout
    // for GEMM2 (the acquire-release count orders every item's h and maxima before them).
    std::vector<std::atomic<int64_t>> items_left(experts.size());
    for (size_t x = 0; x < experts.size(); ++x) items_left[x].store(experts[x].inter / kVnniGroupColumns);
    for_each_group(experts, &PackedExpert::w1, 2, 7 * kVnniGroupColumns,
                   [&](const PackedExpert& ve, int64_t i, VnniNext next, int32_t* scratch) {
                     const int64_t parts = ve.inter / kVnniGroupColumns;  // groups per half, items per row
                     const int64_t part = scratch_rows(ve.rows) * kVnniGroupColumns;
                     const GroupProduct gate = group_product(ve, ve.rows1, *ve.w1, ve.ex.s1, ve.ex.b1, 2 * ve.inter, i,
                                                             VnniNext{ve.w1.get(), i + parts}, scratch);
                     const GroupProduct up = group_product(ve, ve.rows1, *ve.w1, ve.ex.s1, ve.ex.b1, 2 * ve.inter,
                                                           i + parts, next, scratch + 2 * part);
                     swiglu_group(gate, up, ve.rows, a + ve.start, reinterpret_cast<float*>(scratch + 4 * part),
                                  d_ptr + ve.d_at + gate.col, ve.inter, ng_ptr + ve.gate_at + i, parts, vec);
                     if (items_left[&ve - experts.data()].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
                     thread_local KeptBuffer q2_space;
                     int8_t* const q2 = q2_space.get<int8_t>(ve.inter);
                     for (int64_t r = 0; r < ve.rows; ++r) {
                       const float* part_max = ng_ptr + ve.gate_at + r * parts;
                       float m = 0.f;
                       for (int64_t p = 0; p < parts; ++p) m = abs_max(m, part_max[p]);
                       b[ve.start + r] = requant_row(d_ptr + ve.d_at + r * ve.inter, m, q2, ve.inter, vec,
                                                     r + 1 < ve.rows ? d_ptr + ve.d_at + (r + 1) * ve.inter : nullptr);
                       set_row(ve.rows2, r, q2);
                     }
                   });
  } else {
    for_each_group(experts, &PackedExpert::w1, 1, 2 * kVnniGroupColumns,
                   [&](const PackedExpert& ve, int64_t g, VnniNext next, int32_t* acc) {
                     const int64_t width = 2 * ve.inter;
                     const GroupProduct p =
                         group_product(ve, ve.rows1, *ve.w1, ve.ex.s1, ve.ex.b1, width, g, next, acc);
                     const int64_t gate_cols = std::clamp<int64_t>(ve.inter - p.col, 0, p.cols);
                     float* const d_group = d_ptr + ve.d_at + p.col;
                     dequant_group_rows(p, ve.rows, a + ve.start, d_group, width, vec);
                     for (int64_t r = 0; r < ve.rows; ++r) {
                       negate_row(d_group + r * width, ng_ptr + ve.gate_at + r * ve.inter + p.col, gate_cols, vec);
                     }
                   });
  }

  // Unfused: SwiGLU and the requantisation in a region of their own (B). ATen's exp computes each
  // element alike wherever it sits in the tensor (vectorised, the tail too), so one call over every
  // expert's block gives what per-expert calls give. Region B runs over blocks of rows (an expert may
  // be all the work); few values: exp (without the dispatcher under the AVX512 variant, exp_direct)
  // and region B run on this thread (ATen does not fork inside an inline parallel_for).
  if (!fused) {
    constexpr int64_t kSwigluRows = 8;
    std::vector<std::pair<int64_t, int64_t>> row_blocks;  // (expert, first row)
    int64_t max_inter = 0;
    for (int64_t x = 0; x < static_cast<int64_t>(experts.size()); ++x) {
      for (int64_t r = 0; r < experts[x].rows; r += kSwigluRows) row_blocks.emplace_back(x, r);
      max_inter = std::max(max_inter, experts[x].inter);
    }
    const int64_t n_blocks = static_cast<int64_t>(row_blocks.size());
    const bool inline_b = h_size <= 32768;
    const bool direct_exp = inline_b && vec && exp_direct_available();
    at::Tensor neg_gate = at::from_blob(ng_ptr, {gate_size}, at::TensorOptions().dtype(at::kFloat));
    if (!inline_b) at::exp_(neg_gate);
    at::parallel_for(0, n_blocks, inline_b ? n_blocks : 1, [&](int64_t i0, int64_t i1) {
      if (direct_exp) {
        exp_direct(ng_ptr, gate_size);
      } else if (inline_b) {
        at::exp_(neg_gate);
      }
      thread_local KeptBuffer row_space;
      float* const h = row_space.get<float>(2 * max_inter);  // then q2's bytes
      int8_t* const q2 = reinterpret_cast<int8_t*>(h + max_inter);
      for (int64_t i = i0; i < i1; ++i) {
        const PackedExpert& ve = experts[row_blocks[i].first];
        for (int64_t r = row_blocks[i].second; r < std::min(ve.rows, row_blocks[i].second + kSwigluRows); ++r) {
          const float* gate = d_ptr + ve.d_at + r * 2 * ve.inter;
          b[ve.start + r] = swiglu_requant_row(gate, gate + ve.inter, ng_ptr + ve.gate_at + r * ve.inter, h, q2,
                                               ve.inter, vec);
          set_row(ve.rows2, r, q2);
        }
      }
    });
  }
  for_each_group(experts, &PackedExpert::w2, 1, 2 * kVnniGroupColumns,
                 [&](const PackedExpert& ve, int64_t g, VnniNext next, int32_t* acc) {
                   const GroupProduct p = group_product(ve, ve.rows2, *ve.w2, ve.ex.s2, ve.ex.b2, hidden, g, next, acc);
                   dequant_cast_group_rows(p, ve.rows, b + ve.start, y + ve.start * hidden + p.col, hidden, vec,
                                           stream_y);
                 });
  stage.trim();
}

// Steps 2-4 on `grouped_rows` (checked by the caller; group_sizes[e] of them for local expert e, in
// order). `load(e)` gives expert e's weights. Returns y [rows, H] of out_dtype. Experts whose rows
// pick a packed GEMM run together (experts_packed), the others (`_int_mm`) one after another
// (expert_alone).
template <typename Load>
at::Tensor ffn_on_rows(const char* name, const GroupedRows& grouped_rows, c10::IntArrayRef group_sizes,
                       at::ScalarType out_dtype, const Load& load) {
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "_cam_jit_cpu::", name, ": out_dtype must be bfloat16 or float16");
  const int64_t hidden = grouped_rows.hidden;
  int64_t grouped = 0;
  for (const int64_t n : group_sizes) {
    TORCH_CHECK(n >= 0, "_cam_jit_cpu::", name, ": negative group size");
    grouped += n;
  }
  TORCH_CHECK(grouped == grouped_rows.count, "_cam_jit_cpu::", name, ": group sizes sum to ", grouped,
              " but there are ", grouped_rows.count, " rows");
  at::Tensor y = at::empty({grouped_rows.count, hidden}, at::TensorOptions().dtype(out_dtype));
  std::vector<PackedExpert> packed_experts;
  int64_t start = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(group_sizes.size()); ++e) {
    const int64_t rows = group_sizes[e];
    if (rows == 0) continue;
    const Expert ex = load(e);
    const int64_t pack = ex.int4 ? 8 : 1;  // logical columns per stored element
    TORCH_CHECK(ex.w1.size(0) == hidden && (ex.w1.size(1) * pack) % 2 == 0, "_cam_jit_cpu::", name,
                ": expert ", e, " gmm1 weight must be [", hidden, ", 2I] (unpacked), got ", ex.w1.sizes());
    const int64_t inter = ex.w1.size(1) * pack / 2;
    TORCH_CHECK(ex.w2.size(0) == inter && ex.w2.size(1) * pack == hidden, "_cam_jit_cpu::", name,
                ": expert ", e, " gmm2 weight must be [", inter, ", ", hidden, "] (unpacked), got ", ex.w2.sizes());
    TORCH_CHECK(ex.s1.numel == 2 * inter && ex.s2.numel == hidden &&
                    (!ex.int4 || (ex.b1.numel == 2 * inter && ex.b2.numel == hidden)),
                "_cam_jit_cpu::", name, ": expert ", e, " scale or bias lengths");
    const GemmKernel kernel = gemm_kernel(rows);
    if (kernel != GemmKernel::kIntMm) {
      packed_experts.push_back(PackedExpert{start, rows, inter, kernel, ex, nullptr, nullptr, {}, {}, 0, 0});
    } else {
      at::Tensor qe = at::empty({rows, hidden}, at::TensorOptions().dtype(at::kChar));
      int8_t* qe_rows = qe.data_ptr<int8_t>();
      for (int64_t r = 0; r < rows; ++r) std::memcpy(qe_rows + r * hidden, grouped_rows.row(start + r), hidden);
      AT_DISPATCH_REDUCED_FLOATING_TYPES(out_dtype, "expert_ffn", [&] {
        expert_alone<scalar_t>(qe, grouped_rows.scale + start, ex, inter, y.data_ptr<scalar_t>() + start * hidden);
      });
    }
    start += rows;
  }
  // SwiGLU in GEMM1's epilogue (experts_packed) where every expert allows it: 2-4 % faster at BS 1-256.
  bool fused = !packed_experts.empty() && exp_direct_available();
  for (const PackedExpert& pe : packed_experts) fused = fused && pe.inter % kVnniGroupColumns == 0;
  // The packed experts in batches (at least one expert each), so that the float stages between the
  // GEMMs stay in cache; fewer, larger batches have fewer parallel regions. Unfused: about 2 MiB of
  // GEMM1 output (8-9 % faster than 1 MiB at BS 64-256 on the Xeon). Fused, where a row keeps only
  // h: up to 7.5 MiB of stage buffer (h and both GEMMs' rows), under the 8 MiB a thread keeps across
  // calls (at BS 256 one batch, 1-5 % faster than batches of 2 MiB of GEMM1 output on the EPYC).
  const int64_t batch_bytes = fused ? 15 << 19 : 2 << 20;
  const auto expert_bytes = [&](const PackedExpert& pe) {
    return fused ? pe.rows * (4 * pe.inter + 4 * pe.inter / kVnniGroupColumns + hidden + pe.inter)
                 : pe.rows * 2 * pe.inter * 4;
  };
  const bool stream_y = stream_expert_output(y.nbytes());
  for (auto first = packed_experts.begin(); first != packed_experts.end();) {
    auto last = first + 1;
    for (int64_t bytes = expert_bytes(*first);
         last != packed_experts.end() && bytes + expert_bytes(*last) <= batch_bytes; ++last) {
      bytes += expert_bytes(*last);
    }
    std::vector<PackedExpert> batch(first, last);
    AT_DISPATCH_REDUCED_FLOATING_TYPES(out_dtype, "expert_ffn", [&] {
      experts_packed<scalar_t>(batch, grouped_rows, y.data_ptr<scalar_t>(), hidden, fused, stream_y);
    });
    first = last;
  }
  return y;
}

// Steps 2-4 for M rows of int8 grouped by local expert (group_sizes[e] rows for expert e, in order):
// q [M, H] with per-row scales q_scale [M] float32, or, with `row_index` (int64 [M]), row i is
// q[row_index[i]] with scale q_scale[row_index[i]]: the checks of q, q_scale and the index, then
// ffn_on_rows.
template <typename Load>
at::Tensor expert_ffn(const char* name, const at::Tensor& q, const at::Tensor& q_scale, c10::IntArrayRef group_sizes,
                      at::ScalarType out_dtype, const c10::optional<at::Tensor>& row_index, const Load& load) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "_cam_jit_cpu::", name, ": q must be int8 2-D");
  TORCH_CHECK(q_scale.scalar_type() == at::kFloat && q_scale.numel() == q.size(0),
              "_cam_jit_cpu::", name, ": q_scale must be float32 [", q.size(0), "]");
  const at::Tensor qc = q.contiguous();
  const at::Tensor ac = q_scale.contiguous();
  at::Tensor index;
  if (row_index.has_value()) {
    check_cpu(*row_index, "rows");
    TORCH_CHECK(row_index->dim() == 1 && row_index->scalar_type() == at::kLong, "_cam_jit_cpu::", name,
                ": rows must be a 1-D int64 tensor, got ", row_index->scalar_type(), " ", row_index->sizes());
    index = row_index->contiguous();
  }
  const int64_t total_rows = index.defined() ? index.numel() : q.size(0);
  const int64_t hidden = q.size(1);
  // The rows' scales in expert order: q_scale itself, or gathered through the index (checked).
  const float* scale = ac.data_ptr<float>();
  const int64_t* idx = index.defined() ? index.data_ptr<int64_t>() : nullptr;
  std::vector<float> gathered;
  if (idx != nullptr) {
    gathered.resize(total_rows);
    for (int64_t i = 0; i < total_rows; ++i) {
      TORCH_CHECK(idx[i] >= 0 && idx[i] < q.size(0), "_cam_jit_cpu::", name, ": rows[", i, "] = ", idx[i],
                  " outside [0, ", q.size(0), ")");
      gathered[i] = scale[idx[i]];
    }
    scale = gathered.data();
  }
  return ffn_on_rows(name, GroupedRows{qc.data_ptr<int8_t>(), idx, scale, hidden, total_rows}, group_sizes, out_dtype,
                     load);
}

// A weight matrix of expert e as stored: int8 (W8A8) or int32 words of packed int4 values.
ExpertMatrix int_weight(const char* name, const char* arg, at::TensorList container, int64_t e, bool packed) {
  const ExpertSlot slot = expert_slot(container, e, 2);
  const ExpertMatrix w{slot.of, slot.e};
  const at::ScalarType want = packed ? at::kInt : at::kChar;
  TORCH_CHECK(w.of.scalar_type() == want && w.sizes().size() == 2, "_cam_jit_cpu::", name, ": expert ", e, " ", arg,
              " must be a 2-D ", packed ? "int32" : "int8", " matrix, got ", w.of.scalar_type(), " ", w.sizes());
  check_cpu(w.of, arg);
  return w;
}

// Expert e's weights from W8A8 (int8 matrices, no biases) or W4A8 (int32 words, biases) containers.
Expert load_expert(const char* name, bool int4, at::TensorList w1, at::TensorList s1, at::TensorList b1,
                   at::TensorList w2, at::TensorList s2, at::TensorList b2, int64_t e) {
  return Expert{int_weight(name, "gmm1 weight", w1, e, int4), float_item(s1, e),
                int4 ? float_item(b1, e) : ExpertVector(), int_weight(name, "gmm2 weight", w2, e, int4),
                float_item(s2, e), int4 ? float_item(b2, e) : ExpertVector(), int4};
}

}  // namespace

at::Tensor expert_ffn_grouped(const GroupedRows& rows, c10::IntArrayRef group_sizes, at::TensorList w1,
                              at::TensorList s1, at::TensorList b1, at::TensorList w2, at::TensorList s2,
                              at::TensorList b2, at::ScalarType out_dtype) {
  TORCH_CHECK(!w1.empty(), "_cam_jit_cpu::expert_ffn: w1 must hold at least one tensor");
  const bool int4 = w1[0].scalar_type() == at::kInt;
  const char* name = int4 ? "expert_ffn_w4a8" : "expert_ffn_w8a8";
  return ffn_on_rows(name, rows, group_sizes, out_dtype,
                     [&](int64_t e) { return load_expert(name, int4, w1, s1, b1, w2, s2, b2, e); });
}

at::Tensor expert_ffn_w8a8(const at::Tensor& q, const at::Tensor& q_scale, c10::IntArrayRef group_sizes,
                           at::TensorList w1, at::TensorList s1, at::TensorList w2, at::TensorList s2,
                           at::ScalarType out_dtype, const c10::optional<at::Tensor>& rows) {
  constexpr const char* name = "expert_ffn_w8a8";
  return expert_ffn(name, q, q_scale, group_sizes, out_dtype, rows,
                    [&](int64_t e) { return load_expert(name, false, w1, s1, {}, w2, s2, {}, e); });
}

at::Tensor expert_ffn_w4a8(const at::Tensor& q, const at::Tensor& q_scale, c10::IntArrayRef group_sizes,
                           at::TensorList w1, at::TensorList s1, at::TensorList b1, at::TensorList w2,
                           at::TensorList s2, at::TensorList b2, at::ScalarType out_dtype,
                           const c10::optional<at::Tensor>& rows) {
  constexpr const char* name = "expert_ffn_w4a8";
  return expert_ffn(name, q, q_scale, group_sizes, out_dtype, rows,
                    [&](int64_t e) { return load_expert(name, true, w1, s1, b1, w2, s2, b2, e); });
}

}  // namespace cam_jit_cpu

TORCH_LIBRARY_FRAGMENT(_cam_jit_cpu, m) {
  m.def(
      "expert_ffn_w8a8(Tensor q, Tensor q_scale, int[] group_sizes, Tensor[] w1, Tensor[] s1, Tensor[] w2, "
      "Tensor[] s2, ScalarType out_dtype, Tensor? rows=None) -> Tensor");
  m.def(
      "expert_ffn_w4a8(Tensor q, Tensor q_scale, int[] group_sizes, Tensor[] w1, Tensor[] s1, Tensor[] b1, "
      "Tensor[] w2, Tensor[] s2, Tensor[] b2, ScalarType out_dtype, Tensor? rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(_cam_jit_cpu, CPU, m) {
  m.impl("expert_ffn_w8a8", &cam_jit_cpu::expert_ffn_w8a8);
  m.impl("expert_ffn_w4a8", &cam_jit_cpu::expert_ffn_w4a8);
}
