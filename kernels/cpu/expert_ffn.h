// The expert FFN of fused_deep_moe on CPU (expert_ffn.cpp; docs/semantics.md §1.8 steps 2-4, §1.9
// for W4A8), for the kernels that call it in the same C++ call as the routing and combine. Also
// the ops _cam_jit_cpu::expert_ffn_w8a8 / _w4a8.
#pragma once

#include <ATen/core/Tensor.h>

namespace cam_jit_cpu {

// The int8 rows of the expert FFN in expert order: row i is q[index[i]] (or q[i] without an index) of
// `hidden` columns, with the row scale scale[i] (float32, one per grouped row).
struct GroupedRows {
  const int8_t* q;
  const int64_t* index;
  const float* scale;
  int64_t hidden, count;
  const int8_t* row(int64_t i) const { return q + (index != nullptr ? index[i] : i) * hidden; }
};

// expert_ffn_w8a8 (int8 w1) or expert_ffn_w4a8 (int32 w1; b1, b2 its biases, empty under W8A8) on
// rows the caller has checked (indices in range, scales per grouped row).
at::Tensor expert_ffn_grouped(const GroupedRows& rows, c10::IntArrayRef group_sizes, at::TensorList w1,
                              at::TensorList s1, at::TensorList b1, at::TensorList w2, at::TensorList s2,
                              at::TensorList b2, at::ScalarType out_dtype);

// q: [M, H] int8 rows grouped by local expert (group_sizes[e] rows for expert e), or with rows
// (int64 [M]) the rows q[rows[i]]; q_scale: float32, one per row of q; w1/s1/w2/s2: weight
// containers (§1.3) of [H, 2I] int8, [2I] float, [I, H] int8, [H] float. Returns y: [M, H] of
// out_dtype (bfloat16 or float16).
at::Tensor expert_ffn_w8a8(const at::Tensor& q, const at::Tensor& q_scale, c10::IntArrayRef group_sizes,
                           at::TensorList w1, at::TensorList s1, at::TensorList w2, at::TensorList s2,
                           at::ScalarType out_dtype, const c10::optional<at::Tensor>& rows);

// As expert_ffn_w8a8 with W4A8 weights (§1.5, §1.9): w1 [H, 2I/8] and w2 [I, H/8] int32 words of
// packed int4 values, b1 [2I] and b2 [H] float32 compensation biases (containers as the others).
at::Tensor expert_ffn_w4a8(const at::Tensor& q, const at::Tensor& q_scale, c10::IntArrayRef group_sizes,
                           at::TensorList w1, at::TensorList s1, at::TensorList b1, at::TensorList w2,
                           at::TensorList s2, at::TensorList b2, at::ScalarType out_dtype,
                           const c10::optional<at::Tensor>& rows);

}  // namespace cam_jit_cpu
