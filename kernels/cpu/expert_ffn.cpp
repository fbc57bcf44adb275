// Expert-side kernel of fused_deep_moe on CPU: per local expert, int8 GEMM1, dequant + SwiGLU +
// requant, int8 GEMM2, dequant (SPEC.md §1.8 steps 2-4). The integer GEMMs are ATen's exact
// int8 x int8 -> int32 `_int_mm`; the epilogues are fused loops threaded with at::parallel_for.
#include "moe_common.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>

#include <algorithm>
#include <vector>

namespace cam_jit_cpu {
namespace {

int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// Scale vector of one expert, widened exactly to float32 and contiguous.
at::Tensor float_scale(at::TensorList container, int64_t e) {
  return expert_item(container, e, 1).to(at::kFloat).contiguous();
}

// Step 2.2-2.4: d[r, j] = (f32(acc[r, j]) * s1[j]) * a[r]. Also writes -d of the gate half into
// neg_gate so that exp can run over one contiguous block with ATen's vectorised kernel.
void dequant_gmm1(const at::Tensor& acc, const at::Tensor& s1, const float* a, at::Tensor& d,
                  at::Tensor& neg_gate) {
  const int64_t rows = acc.size(0);
  const int64_t width = acc.size(1);
  const int64_t inter = width / 2;
  const int32_t* acc_ptr = acc.data_ptr<int32_t>();
  const float* s_ptr = s1.data_ptr<float>();
  float* d_ptr = d.data_ptr<float>();
  float* ng_ptr = neg_gate.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* ar = acc_ptr + r * width;
      float* dr = d_ptr + r * width;
      const float token_scale = a[r];
      for (int64_t j = 0; j < width; ++j) {
        const float c = static_cast<float>(ar[j]) * s_ptr[j];
        dr[j] = c * token_scale;
      }
      float* ng = ng_ptr + r * inter;
      for (int64_t j = 0; j < inter; ++j) {
        ng[j] = -dr[j];
      }
    }
  });
}

// Steps 2.5-3.4: G = d_gate / (exp(-d_gate) + 1), h = G * d_up, q2 = rint((h * 127) * (1 / m)),
// b = m * (1/127) with m = max|h| per row. exp_neg holds exp(-d_gate).
void swiglu_requant(const at::Tensor& d, const at::Tensor& exp_neg, at::Tensor& q2, float* b) {
  const int64_t rows = d.size(0);
  const int64_t inter = d.size(1) / 2;
  const float* d_ptr = d.data_ptr<float>();
  const float* u_ptr = exp_neg.data_ptr<float>();
  int8_t* q_ptr = q2.data_ptr<int8_t>();
  const float inv127 = 1.f / 127.f;
  at::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    std::vector<float> h(inter);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = d_ptr + r * 2 * inter;
      const float* up = gate + inter;
      const float* u = u_ptr + r * inter;
      float m = 0.f;
      for (int64_t j = 0; j < inter; ++j) {
        const float denom = u[j] + 1.f;
        const float g = gate[j] / denom;
        h[j] = g * up[j];
        m = abs_max(m, h[j]);
      }
      int8_t* qr = q_ptr + r * inter;
      const float inv_m = 1.f / m;
      if (std::isinf(inv_m)) {  // m 0 or subnormal, SPEC.md §1.11
        std::fill(qr, qr + inter, int8_t{0});
        b[r] = 0.f;
        continue;
      }
      for (int64_t j = 0; j < inter; ++j) {
        const float scaled = h[j] * 127.f;
        qr[j] = round_to_int8(scaled * inv_m);
      }
      b[r] = m * inv127;
    }
  });
}

// Step 4.2: y[r, j] = cast((f32(acc[r, j]) * s2[j]) * b[r]) into rows of `out`.
template <typename scalar_t>
void dequant_gmm2(const at::Tensor& acc, const at::Tensor& s2, const float* b, scalar_t* out) {
  const int64_t rows = acc.size(0);
  const int64_t width = acc.size(1);
  const int32_t* acc_ptr = acc.data_ptr<int32_t>();
  const float* s_ptr = s2.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* ar = acc_ptr + r * width;
      scalar_t* yr = out + r * width;
      const float token_scale = b[r];
      for (int64_t j = 0; j < width; ++j) {
        const float c = static_cast<float>(ar[j]) * s_ptr[j];
        yr[j] = static_cast<scalar_t>(c * token_scale);
      }
    }
  });
}

// q: [M, H] int8 rows grouped by local expert (group_sizes[e] rows for expert e, in order);
// q_scale: [M] float32 per-row dequantisation scale; w1/s1/w2/s2: weight containers (§1.3) of
// [H, 2I] int8, [2I] float, [I, H] int8, [H] float. Returns y: [M, H] of out_dtype.
at::Tensor expert_ffn_w8a8(const at::Tensor& q, const at::Tensor& q_scale, c10::IntArrayRef group_sizes,
                           at::TensorList w1, at::TensorList s1, at::TensorList w2, at::TensorList s2,
                           at::ScalarType out_dtype) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "_cam_jit_cpu::expert_ffn_w8a8: q must be int8 2-D");
  TORCH_CHECK(q_scale.scalar_type() == at::kFloat && q_scale.numel() == q.size(0),
              "_cam_jit_cpu::expert_ffn_w8a8: q_scale must be float32 [", q.size(0), "]");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "_cam_jit_cpu::expert_ffn_w8a8: out_dtype must be bfloat16 or float16");
  const int64_t total_rows = q.size(0);
  const int64_t hidden = q.size(1);
  int64_t grouped = 0;
  for (const int64_t n : group_sizes) {
    TORCH_CHECK(n >= 0, "_cam_jit_cpu::expert_ffn_w8a8: negative group size");
    grouped += n;
  }
  TORCH_CHECK(grouped == total_rows, "_cam_jit_cpu::expert_ffn_w8a8: group sizes sum to ", grouped,
              " but q has ", total_rows, " rows");

  const at::Tensor qc = q.contiguous();
  const at::Tensor ac = q_scale.contiguous();
  at::Tensor y = at::empty({total_rows, hidden}, qc.options().dtype(out_dtype));
  int64_t start = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(group_sizes.size()); ++e) {
    const int64_t rows = group_sizes[e];
    if (rows == 0) continue;
    const at::Tensor w1e = expert_item(w1, e, 2).contiguous();
    const at::Tensor w2e = expert_item(w2, e, 2).contiguous();
    TORCH_CHECK(w1e.scalar_type() == at::kChar && w1e.dim() == 2 && w1e.size(0) == hidden && w1e.size(1) % 2 == 0,
                "_cam_jit_cpu::expert_ffn_w8a8: expert ", e, " gmm1 weight must be int8 [", hidden, ", 2I], got ",
                w1e.sizes());
    const int64_t inter = w1e.size(1) / 2;
    TORCH_CHECK(w2e.scalar_type() == at::kChar && w2e.dim() == 2 && w2e.size(0) == inter && w2e.size(1) == hidden,
                "_cam_jit_cpu::expert_ffn_w8a8: expert ", e, " gmm2 weight must be int8 [", inter, ", ", hidden,
                "], got ", w2e.sizes());
    const at::Tensor s1e = float_scale(s1, e);
    const at::Tensor s2e = float_scale(s2, e);
    TORCH_CHECK(s1e.numel() == 2 * inter && s2e.numel() == hidden,
                "_cam_jit_cpu::expert_ffn_w8a8: expert ", e, " scale lengths");

    const at::Tensor qe = qc.narrow(0, start, rows);
    const float* a = ac.data_ptr<float>() + start;
    const at::Tensor acc1 = at::_int_mm(qe, w1e);
    at::Tensor d = at::empty({rows, 2 * inter}, ac.options());
    at::Tensor neg_gate = at::empty({rows, inter}, ac.options());
    dequant_gmm1(acc1, s1e, a, d, neg_gate);
    at::exp_(neg_gate);
    at::Tensor q2 = at::empty({rows, inter}, qc.options());
    std::vector<float> b(rows);
    swiglu_requant(d, neg_gate, q2, b.data());
    const at::Tensor acc2 = at::_int_mm(q2, w2e);
    AT_DISPATCH_REDUCED_FLOATING_TYPES(out_dtype, "expert_ffn_w8a8", [&] {
      dequant_gmm2<scalar_t>(acc2, s2e, b.data(), y.data_ptr<scalar_t>() + start * hidden);
    });
    start += rows;
  }
  return y;
}

}  // namespace
}  // namespace cam_jit_cpu

TORCH_LIBRARY_FRAGMENT(_cam_jit_cpu, m) {
  m.def(
      "expert_ffn_w8a8(Tensor q, Tensor q_scale, int[] group_sizes, Tensor[] w1, Tensor[] s1, Tensor[] w2, "
      "Tensor[] s2, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(_cam_jit_cpu, CPU, m) { m.impl("expert_ffn_w8a8", &cam_jit_cpu::expert_ffn_w8a8); }
