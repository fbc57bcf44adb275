// torch op <ns>::reduce_scatter_detour -> aclnnReduceScatterDetour (docs/semantics.md §3.3, §7.2): inputs
// sendData, commRankIds, commArgs; int64 attributes magic, rankSize, op (upstream passed int32
// locals for the first two: docs/semantics.md §7.1); output out (allocated by the caller).
#include "wrappers.h"

namespace cam_jit_npu {

void reduce_scatter_detour(const at::Tensor& send_data, const at::Tensor& comm_rank_ids,
                           const at::Tensor& comm_args, int64_t magic, int64_t rank_size,
                           int64_t op, const at::Tensor& out) {
  AclnnCall call("reduce_scatter_detour", send_data);
  auto* a_send = call.tensor("sendData", send_data);
  auto* a_ids = call.tensor("commRankIds", comm_rank_ids);
  auto* a_args = call.tensor("commArgs", comm_args);
  auto* a_out = call.tensor("out", out);
  call.run(a_send, a_ids, a_args, magic, rank_size, op, a_out);
}

}  // namespace cam_jit_npu
