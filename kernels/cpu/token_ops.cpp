// Token-side kernels of fused_deep_moe on CPU: dispatch quantisation and the weighted combine.
#include "elementwise.h"
#include "expert_ffn.h"
#include "int8_gemm.h"
#include "moe_common.h"
#include "routing.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace cam_jit_cpu {
namespace {

// docs/semantics.md §1.8 step 1 for `rows` output rows into q [rows, H] int8 and scale [rows]: output
// row i quantises xc[xi[i]] (or xc[i]; xc contiguous), multiplied element-wise by smooth row
// sm[si[i]] (or sm[i]) of sm_rows when sm is given.
void quantize_into(const at::Tensor& xc, int64_t rows, const int64_t* xi_ptr, const float* sm_ptr,
                   const int64_t* si_ptr, int64_t sm_rows, int8_t* q_ptr, float* scale_ptr) {
  const int64_t hidden = xc.size(1);
  const int64_t x_rows = xc.size(0);
  const bool vec = vector_kernel() == VectorKernel::kAvx512;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(xc.scalar_type(), "quantize_rows", [&] {
    constexpr bool bf16 = std::is_same_v<scalar_t, c10::BFloat16>;
    const scalar_t* x_ptr = xc.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      thread_local KeptBuffer row_space;
      float* const v = row_space.get<float>(hidden);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t src = xi_ptr ? xi_ptr[i] : i;
        TORCH_CHECK(src >= 0 && src < x_rows, "_cam_jit_cpu::quantize_rows: x_index out of range");
        const scalar_t* xr = x_ptr + src * hidden;
        float amax = 0.f;
        const float* sr = nullptr;
        if (sm_ptr) {
          const int64_t s = si_ptr ? si_ptr[i] : i;
          TORCH_CHECK(s >= 0 && s < sm_rows, "_cam_jit_cpu::quantize_rows: smooth_index out of range");
          sr = sm_ptr + s * hidden;
        }
#if defined(__x86_64__)
        if (bf16 && vec) {
          avx512::bf16_to_float(reinterpret_cast<const uint16_t*>(xr), sr, v, hidden);
          amax = avx512::abs_max(v, hidden);
        } else
#endif
        if (sr) {
          for (int64_t j = 0; j < hidden; ++j) {
            v[j] = static_cast<float>(xr[j]) * sr[j];
            amax = abs_max(amax, v[j]);
          }
        } else {
          for (int64_t j = 0; j < hidden; ++j) {
            v[j] = static_cast<float>(xr[j]);
            amax = abs_max(amax, v[j]);
          }
        }
        int8_t* qr = q_ptr + i * hidden;
        const float s_q = 127.f / amax;
        if (std::isinf(s_q)) {  // amax 0 or subnormal, docs/semantics.md §1.11: zero row, zero scale, never NaN
          std::fill(qr, qr + hidden, int8_t{0});
          scale_ptr[i] = 0.f;
          continue;
        }
        scale_ptr[i] = 1.f / s_q;
#if defined(__x86_64__)
        if (vec) {
          avx512::quantize(v, 0.f, s_q, qr, hidden);
          continue;
        }
#endif
        for (int64_t j = 0; j < hidden; ++j) {
          qr[j] = round_to_int8(v[j] * s_q);
        }
      }
    });
  });
}

// docs/semantics.md §1.8 step 1 for `n` output rows. Output row i quantises x[x_index[i]] (or x[i]),
// multiplied element-wise by smooth_scales[smooth_index[i]] (or smooth_scales[i]) when given.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x,
                                                 const c10::optional<at::Tensor>& smooth_scales,
                                                 const c10::optional<at::Tensor>& x_index,
                                                 const c10::optional<at::Tensor>& smooth_index) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2, "_cam_jit_cpu::quantize_rows: x must be 2-D, got ", x.sizes());
  const int64_t hidden = x.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor xi, sm, si;
  if (x_index.has_value()) {
    xi = x_index->to(at::kLong).contiguous();
  }
  if (smooth_scales.has_value()) {
    sm = smooth_scales->contiguous();
    TORCH_CHECK(sm.scalar_type() == at::kFloat && sm.dim() == 2 && sm.size(1) == hidden,
                "_cam_jit_cpu::quantize_rows: smooth_scales must be float32 [*, ", hidden, "]");
    if (smooth_index.has_value()) {
      si = smooth_index->to(at::kLong).contiguous();
    }
  }
  const int64_t rows = xi.defined() ? xi.numel() : xc.size(0);
  TORCH_CHECK(!si.defined() || si.numel() == rows, "_cam_jit_cpu::quantize_rows: smooth_index length");
  TORCH_CHECK(!sm.defined() || si.defined() || sm.size(0) == rows,
              "_cam_jit_cpu::quantize_rows: smooth_scales rows must match the output rows");

  at::Tensor q = at::empty({rows, hidden}, xc.options().dtype(at::kChar));
  at::Tensor scale = at::empty({rows}, xc.options().dtype(at::kFloat));
  quantize_into(xc, rows, xi.defined() ? xi.data_ptr<int64_t>() : nullptr,
                sm.defined() ? sm.data_ptr<float>() : nullptr, si.defined() ? si.data_ptr<int64_t>() : nullptr,
                sm.defined() ? sm.size(0) : 0, q.data_ptr<int8_t>(), scale.data_ptr<float>());
  return {q, scale};
}

// route_pairs' five tensors, then each routed pair's quantised row q [P, H] int8 and scale [P]
// float32 in route order (docs/semantics.md §1.8 step 1): with smooth_scales [E, H] pair (t, k)
// quantises x[t] * smooth_scales[expert]; without, each active token is quantised once and its row
// copied to each of its pairs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_and_quantize(
    const at::Tensor& x, const at::Tensor& expert_ids, int64_t active, int64_t experts,
    const c10::optional<at::Tensor>& smooth_scales) {
  auto [pos, token, expert, counts, pair_rows] = route_pairs(expert_ids, active, experts);
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == expert_ids.size(0), "_cam_jit_cpu::route_and_quantize: x must be [",
              expert_ids.size(0), ", H] (the rows of expert_ids), got ", x.sizes());
  if (smooth_scales.has_value()) {
    auto [q, scale] = quantize_rows(x, smooth_scales, token, expert);
    return {pos, token, expert, counts, pair_rows, q, scale};
  }
  auto [q_token, scale_token] = quantize_rows(x.narrow(0, 0, active), c10::nullopt, c10::nullopt, c10::nullopt);
  const int64_t pairs = token.numel(), hidden = x.size(1);
  at::Tensor q = at::empty({pairs, hidden}, q_token.options());
  at::Tensor scale = at::empty({pairs}, scale_token.options());
  const int64_t* t = token.data_ptr<int64_t>();
  const int8_t* q_from = q_token.data_ptr<int8_t>();
  const float* scale_from = scale_token.data_ptr<float>();
  int8_t* q_to = q.data_ptr<int8_t>();
  float* scale_to = scale.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(hidden, 1));
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(q_to + i * hidden, q_from + t[i] * hidden, static_cast<size_t>(hidden));
      scale_to[i] = scale_from[t[i]];
    }
  });
  return {pos, token, expert, counts, pair_rows, q, scale};
}

// docs/semantics.md §1.8 step 5 on yc (contiguous [y_rows, H]), one expert result per routed pair, with
// pair_rows and weights [batch, topk] int64 / float32 of the caller's (checked but the rows):
// pair_rows[t, k] is the row of yc for pair (t, k), or -1 for a skipped pair. Rows t >= active_count
// are zero.
at::Tensor combine_into(const at::Tensor& yc, const int64_t* pr_ptr, const float* w_ptr, int64_t batch, int64_t topk,
                        int64_t active_count) {
  const int64_t hidden = yc.size(1);
  const int64_t y_rows = yc.size(0);
  at::Tensor out = at::empty({batch, hidden}, yc.options());
  if (active_count < batch) out.narrow(0, active_count, batch - active_count).zero_();  // inactive rows
  const bool vec = vector_kernel() == VectorKernel::kAvx512;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(yc.scalar_type(), "combine", [&] {
    constexpr bool bf16 = std::is_same_v<scalar_t, c10::BFloat16>;
    const scalar_t* y_ptr = yc.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden * std::max<int64_t>(topk, 1), 1));
    at::parallel_for(0, active_count, grain, [&](int64_t begin, int64_t end) {
      thread_local KeptBuffer row_space;  // the float sums of the portable path
      float* const acc = bf16 && vec ? nullptr : row_space.get<float>(hidden);
      std::vector<const uint16_t*> rows(topk), next_rows(topk);
      std::vector<float> row_weights(topk), next_weights(topk);
      // Token t's rows (that is, those of its pairs not skipped) and their weights; returns how many.
      const auto gather = [&](int64_t t, std::vector<const uint16_t*>& to, std::vector<float>& weights) {
        int64_t count = 0;
        for (int64_t k = 0; k < topk; ++k) {
          const int64_t row = pr_ptr[t * topk + k];
          if (row < 0) continue;
          TORCH_CHECK(row < y_rows, "_cam_jit_cpu::combine: pair row ", row, " >= ", y_rows);
          to[count] = reinterpret_cast<const uint16_t*>(y_ptr + row * hidden);
          weights[count++] = w_ptr[t * topk + k];
        }
        return count;
      };
      int64_t next_count = begin < end ? gather(begin, next_rows, next_weights) : 0;
      for (int64_t t = begin; t < end; ++t) {
        std::swap(rows, next_rows);
        std::swap(row_weights, next_weights);
        const int64_t count = next_count;
        next_count = t + 1 < end ? gather(t + 1, next_rows, next_weights) : 0;
        scalar_t* orow = out_ptr + t * hidden;
#if defined(__x86_64__)
        if (bf16 && vec) {
          avx512::combine_bf16(rows.data(), row_weights.data(), count, next_rows.data(), next_count,
                               reinterpret_cast<uint16_t*>(orow), hidden);
          continue;
        }
#endif
        std::fill(acc, acc + hidden, 0.f);
        for (int64_t k = 0; k < count; ++k) {
          const scalar_t* yr = reinterpret_cast<const scalar_t*>(rows[k]);
          for (int64_t j = 0; j < hidden; ++j) {
            const float p = static_cast<float>(yr[j]) * row_weights[k];
            acc[j] = acc[j] + p;
          }
        }
        for (int64_t j = 0; j < hidden; ++j) {
          orow[j] = static_cast<scalar_t>(acc[j]);
        }
      }
    });
  });
  return out;
}

// combine_into on tensors: y [rows, H], pair_rows and weights [BS, K], with their checks.
at::Tensor combine(const at::Tensor& y, const at::Tensor& pair_rows, const at::Tensor& weights,
                   int64_t active_count) {
  check_cpu(y, "y");
  TORCH_CHECK(y.dim() == 2, "_cam_jit_cpu::combine: y must be 2-D, got ", y.sizes());
  TORCH_CHECK(pair_rows.dim() == 2 && pair_rows.sizes() == weights.sizes(),
              "_cam_jit_cpu::combine: pair_rows ", pair_rows.sizes(), " and weights ", weights.sizes(),
              " must be equal 2-D shapes");
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "_cam_jit_cpu::combine: weights must be float32");
  const int64_t batch = pair_rows.size(0);
  const int64_t topk = pair_rows.size(1);
  TORCH_CHECK(active_count >= 0 && active_count <= batch, "_cam_jit_cpu::combine: active_count ",
              active_count, " outside [0, ", batch, "]");
  const at::Tensor pr = pair_rows.to(at::kLong).contiguous();
  return combine_into(y.contiguous(), pr.data_ptr<int64_t>(), weights.contiguous().data_ptr<float>(), batch, topk,
                      active_count);
}

// fused_deep_moe on one rank (docs/semantics.md §1.8; §1.9 for int32 W4A8 weights) in one call:
// routing, quantisation (each active token once, the pairs reading their token's row; with smooth
// scales a row per pair), the expert FFN on the pairs' rows grouped by expert, and combine. Weight
// containers as the expert FFN takes them (b1, b2: W4A8 biases, empty under W8A8). Returns (output
// [BS, H] x.dtype, share_output: zeros [BS, H] x.dtype with zero_share (the op's share_output
// without a shared expert), else [0, H], expert_token_nums [experts] int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_one_rank(
    const at::Tensor& x, const at::Tensor& expert_ids, int64_t active, int64_t experts,
    const c10::optional<at::Tensor>& smooth_scales, const at::Tensor& expert_scales, at::TensorList w1,
    at::TensorList s1, at::TensorList b1, at::TensorList w2, at::TensorList s2, at::TensorList b2, bool zero_share) {
  TORCH_CHECK(!w1.empty(), "_cam_jit_cpu::moe_one_rank: w1 must hold at least one tensor");
  const at::Tensor ids = expert_ids.contiguous();
  const int32_t* id = checked_ids(ids, active, experts);
  const int64_t batch = ids.size(0), topk = ids.size(1);
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == batch, "_cam_jit_cpu::moe_one_rank: x must be [", batch,
              ", H] (the rows of expert_ids), got ", x.sizes());
  check_cpu(expert_scales, "expert_scales");
  TORCH_CHECK(expert_scales.scalar_type() == at::kFloat && expert_scales.sizes() == ids.sizes(),
              "_cam_jit_cpu::moe_one_rank: expert_scales must be float32 ", ids.sizes(), ", got ",
              expert_scales.scalar_type(), " ", expert_scales.sizes());
  const int64_t hidden = x.size(1);
  at::Tensor smooth;
  if (smooth_scales.has_value()) {
    smooth = smooth_scales->contiguous();
    check_cpu(smooth, "smooth_scales");
    TORCH_CHECK(smooth.scalar_type() == at::kFloat && smooth.dim() == 2 && smooth.size(1) == hidden,
                "_cam_jit_cpu::moe_one_rank: smooth_scales must be float32 [*, ", hidden, "], got ",
                smooth.scalar_type(), " ", smooth.sizes());
  }
  // The routing and the quantised rows, in memory this thread keeps across calls: with smooth
  // scales a row per pair (its token's row times its expert's scales), else each active token
  // quantised once and the pairs reading their token's row.
  const bool per_pair = smooth.defined();
  at::Tensor counts = at::empty({experts}, ids.options().dtype(at::kLong));
  const int64_t pairs = route_count(id, topk, active, experts, counts.data_ptr<int64_t>());
  const int64_t q_rows = per_pair ? pairs : active;
  const int64_t expert_at = round_up(pairs * 8, 64), rows_at = expert_at + round_up(pairs * 8, 64),
                pair_scale_at = rows_at + round_up(batch * topk * 8, 64),
                q_at = pair_scale_at + round_up(pairs * 4, 64), scale_at = q_at + round_up(q_rows * hidden, 64);
  thread_local KeptBuffer routed;
  char* const memory = routed.get<char>(scale_at + active * 4);
  int64_t* token = reinterpret_cast<int64_t*>(memory);
  int64_t* expert = reinterpret_cast<int64_t*>(memory + expert_at);
  int64_t* pair_rows = reinterpret_cast<int64_t*>(memory + rows_at);
  float* pair_scale = reinterpret_cast<float*>(memory + pair_scale_at);
  int8_t* q = reinterpret_cast<int8_t*>(memory + q_at);
  float* token_scale = reinterpret_cast<float*>(memory + scale_at);
  route_fill(id, batch, topk, active, experts, counts.data_ptr<int64_t>(), nullptr, token, expert, pair_rows);
  const at::Tensor xc = x.contiguous();
  if (per_pair) {
    quantize_into(xc, pairs, token, smooth.data_ptr<float>(), expert, smooth.size(0), q, pair_scale);
  } else {
    quantize_into(xc, active, nullptr, nullptr, nullptr, 0, q, token_scale);
    for (int64_t i = 0; i < pairs; ++i) pair_scale[i] = token_scale[token[i]];
  }
  const c10::IntArrayRef group_sizes(counts.data_ptr<int64_t>(), experts);
  const at::Tensor y = expert_ffn_grouped(GroupedRows{q, per_pair ? nullptr : token, pair_scale, hidden, pairs},
                                          group_sizes, w1, s1, b1, w2, s2, b2, x.scalar_type());
  const at::Tensor weights = expert_scales.contiguous();
  const at::Tensor output = combine_into(y, pair_rows, weights.data_ptr<float>(), batch, topk, active);
  routed.trim();
  at::Tensor share = at::empty({zero_share ? batch : 0, hidden}, x.options());
  if (zero_share) std::memset(share.data_ptr(), 0, share.nbytes());
  return {output, share, counts};
}

}  // namespace
}  // namespace cam_jit_cpu

TORCH_LIBRARY_FRAGMENT(_cam_jit_cpu, m) {
  m.def("quantize_rows(Tensor x, Tensor? smooth_scales, Tensor? x_index, Tensor? smooth_index) -> (Tensor, Tensor)");
  m.def(
      "route_and_quantize(Tensor x, Tensor expert_ids, int active, int experts, Tensor? smooth_scales) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("combine(Tensor y, Tensor pair_rows, Tensor weights, int active_count) -> Tensor");
  m.def(
      "moe_one_rank(Tensor x, Tensor expert_ids, int active, int experts, Tensor? smooth_scales, Tensor expert_scales, "
      "Tensor[] w1, Tensor[] s1, Tensor[] b1, Tensor[] w2, Tensor[] s2, Tensor[] b2, bool zero_share) -> "
      "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(_cam_jit_cpu, CPU, m) {
  m.impl("quantize_rows", &cam_jit_cpu::quantize_rows);
  m.impl("route_and_quantize", &cam_jit_cpu::route_and_quantize);
  m.impl("combine", &cam_jit_cpu::combine);
  m.impl("moe_one_rank", &cam_jit_cpu::moe_one_rank);
}
