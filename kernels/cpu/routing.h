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

// The same in two passes on memory of the caller's. checked_ids: expert_ids' int32 ids after the
// checks of route_pairs (contiguous, `active` and `experts` in range). route_count: counts[experts] as
// above (each id checked); returns the routed pair count P. route_fill: pos, token and expert [P]
// (any may be null) and pair_rows [BS * K] as above.
const int32_t* checked_ids(const at::Tensor& expert_ids, int64_t active, int64_t experts);
int64_t route_count(const int32_t* id, int64_t topk, int64_t active, int64_t experts, int64_t* counts);
void route_fill(const int32_t* id, int64_t batch, int64_t topk, int64_t active, int64_t experts,
                const int64_t* counts, int64_t* pos, int64_t* token, int64_t* expert, int64_t* pair_rows);

}  // namespace cam_jit_cpu
