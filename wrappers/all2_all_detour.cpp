// torch op <ns>::all2_all_detour -> aclnnAll2AllDetour (docs/semantics.md §3.2, §7.2): inputs sendData,
// commRankIds, commArgs; int64 attribute magic (upstream passed an int32 local: docs/semantics.md §7.1);
// output out (allocated by the caller).
#include "wrappers.h"

namespace cam_jit_npu {

void all2_all_detour(const at::Tensor& send_data, const at::Tensor& comm_rank_ids,
                     const at::Tensor& comm_args, int64_t magic, const at::Tensor& out) {
  AclnnCall call("all2_all_detour", send_data);
  auto* a_send = call.tensor("sendData", send_data);
  auto* a_ids = call.tensor("commRankIds", comm_rank_ids);
  auto* a_args = call.tensor("commArgs", comm_args);
  auto* a_out = call.tensor("out", out);
  call.run(a_send, a_ids, a_args, magic, a_out);
}

}  // namespace cam_jit_npu
