// Routing of fused_deep_moe's (token, k) pairs in one pass: the pairs of the active tokens sorted
// stably by global expert id (a counting sort), per-expert pair counts, and each pair's row in
// that order.
#include "routing.h"

#include "moe_common.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <tuple>
#include <vector>

namespace cam_jit_cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_pairs(const at::Tensor& expert_ids,
                                                                                   int64_t active, int64_t experts) {
  check_cpu(expert_ids, "expert_ids");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.scalar_type() == at::kInt,
              "_cam_jit_cpu::route_pairs: expert_ids must be a 2-D int32 tensor, got ", expert_ids.scalar_type(), " ",
              expert_ids.sizes());
  const int64_t batch = expert_ids.size(0), topk = expert_ids.size(1);
  TORCH_CHECK(active >= 0 && active <= batch, "_cam_jit_cpu::route_pairs: active must be in [0, ", batch, "], got ",
              active);
  TORCH_CHECK(experts >= 0, "_cam_jit_cpu::route_pairs: experts must be >= 0, got ", experts);
  const at::Tensor ids = expert_ids.contiguous();
  const int32_t* id = ids.data_ptr<int32_t>();
  const int64_t pairs_in = active * topk;
  at::Tensor counts = at::zeros({experts}, ids.options().dtype(at::kLong));
  int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs_in; ++i) {
    TORCH_CHECK(id[i] >= -1 && id[i] < experts, "_cam_jit_cpu::route_pairs: expert_ids[", i / topk, ", ",
                i % topk, "] = ", id[i], " outside [-1, ", experts, ")");
    if (id[i] >= 0) ++count[id[i]];
  }
  std::vector<int64_t> next(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) next[e + 1] = next[e] + count[e];
  const int64_t pairs = next[experts];
  const auto long_opts = ids.options().dtype(at::kLong);
  at::Tensor pos = at::empty({pairs}, long_opts), token = at::empty({pairs}, long_opts),
             expert = at::empty({pairs}, long_opts);
  at::Tensor pair_rows = at::empty({batch, topk}, long_opts);
  int64_t* p = pos.data_ptr<int64_t>();
  int64_t* t = token.data_ptr<int64_t>();
  int64_t* x = expert.data_ptr<int64_t>();
  int64_t* rows = pair_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch * topk; ++i) {
    if (i >= pairs_in || id[i] < 0) {
      rows[i] = -1;
      continue;
    }
    const int64_t slot = next[id[i]]++;
    p[slot] = i;
    t[slot] = i / topk;
    x[slot] = id[i];
    rows[i] = slot;
  }
  return {pos, token, expert, counts, pair_rows};
}

}  // namespace cam_jit_cpu

TORCH_LIBRARY_FRAGMENT(_cam_jit_cpu, m) {
  m.def("route_pairs(Tensor expert_ids, int active, int experts) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(_cam_jit_cpu, CPU, m) {
  m.impl("route_pairs", &cam_jit_cpu::route_pairs);
}
