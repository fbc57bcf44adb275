// Routing of fused_deep_moe's (token, k) pairs (routing.cpp), for the kernels that route and then
// work on the routed rows in the same call.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace cam_jit_cpu {

// expert_ids [BS, K] int32 (ids in [-1, experts); -1 skips the pair); the first `active` rows are
// routed, stably sorted by global expert id. Returns (pos [P] int64 = t*K + k, token [P] int64 = t,
// expert [P] int64, counts [experts] int64, pair_rows [BS, K] int64: the pair's index in that order,
// -1 if not routed). An id outside [-1, experts) raises, naming its position.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_pairs(const at::Tensor& expert_ids,
                                                                                   int64_t active, int64_t experts);

}  // namespace cam_jit_cpu
