// Routing of fused_deep_moe's (token, k) pairs: the pairs of the active tokens sorted stably by
// global expert id (a counting sort: count, then place), per-expert pair counts, and each pair's
// row in that order.
#include "routing.h"

#include "moe_common.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <numeric>
#include <tuple>
#include <vector>

namespace cam_jit_cpu {

const int32_t* checked_ids(const at::Tensor& expert_ids, int64_t active, int64_t experts) {
  check_cpu(expert_ids, "expert_ids");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.scalar_type() == at::kInt && expert_ids.is_contiguous(),
              "_cam_jit_cpu::route_pairs: expert_ids must be a contiguous 2-D int32 tensor, got ",
              expert_ids.scalar_type(), " ", expert_ids.sizes());
  TORCH_CHECK(active >= 0 && active <= expert_ids.size(0), "_cam_jit_cpu::route_pairs: active must be in [0, ",
              expert_ids.size(0), "], got ", active);
  TORCH_CHECK(experts >= 0, "_cam_jit_cpu::route_pairs: experts must be >= 0, got ", experts);
  return expert_ids.data_ptr<int32_t>();
}

int64_t route_count(const int32_t* id, int64_t topk, int64_t active, int64_t experts, int64_t* counts) {
  std::fill(counts, counts + experts, int64_t{0});
  const int64_t pairs_in = active * topk;
  for (int64_t i = 0; i < pairs_in; ++i) {
    TORCH_CHECK(id[i] >= -1 && id[i] < experts, "_cam_jit_cpu::route_pairs: expert_ids[", i / topk, ", ",
                i % topk, "] = ", id[i], " outside [-1, ", experts, ")");
    if (id[i] >= 0) ++counts[id[i]];
  }
  return std::accumulate(counts, counts + experts, int64_t{0});
}

void route_fill(const int32_t* id, int64_t batch, int64_t topk, int64_t active, int64_t experts,
                const int64_t* counts, int64_t* pos, int64_t* token, int64_t* expert, int64_t* pair_rows) {
  std::vector<int64_t> next(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) next[e + 1] = next[e] + counts[e];
  const int64_t pairs_in = active * topk;
  for (int64_t i = 0; i < batch * topk; ++i) {
    if (i >= pairs_in || id[i] < 0) {
      pair_rows[i] = -1;
      continue;
    }
    const int64_t slot = next[id[i]]++;
    if (pos != nullptr) pos[slot] = i;
    if (token != nullptr) token[slot] = i / topk;
    if (expert != nullptr) expert[slot] = id[i];
    pair_rows[i] = slot;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_pairs(const at::Tensor& expert_ids,
                                                                                   int64_t active, int64_t experts) {
  const at::Tensor ids = expert_ids.contiguous();
  const int32_t* id = checked_ids(ids, active, experts);
  const int64_t batch = ids.size(0), topk = ids.size(1);
  const auto long_opts = ids.options().dtype(at::kLong);
  at::Tensor counts = at::empty({experts}, long_opts);
  const int64_t pairs = route_count(id, topk, active, experts, counts.data_ptr<int64_t>());
  at::Tensor pos = at::empty({pairs}, long_opts), token = at::empty({pairs}, long_opts),
             expert = at::empty({pairs}, long_opts), pair_rows = at::empty({batch, topk}, long_opts);
  route_fill(id, batch, topk, active, experts, counts.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
             token.data_ptr<int64_t>(), expert.data_ptr<int64_t>(), pair_rows.data_ptr<int64_t>());
  return {pos, token, expert, counts, pair_rows};
}

}  // namespace cam_jit_cpu

TORCH_LIBRARY_FRAGMENT(_cam_jit_cpu, m) {
  m.def("route_pairs(Tensor expert_ids, int active, int experts) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(_cam_jit_cpu, CPU, m) {
  m.impl("route_pairs", &cam_jit_cpu::route_pairs);
}
