// torch op <ns>::e2a -> aclnnE2a (docs/semantics.md §2.4, §7.2): inputs expandX, attenBatchSize; int64
// attributes batchSize, hiddenSize, topk, expertRankSize, attentionRankSize, rank, then
// char* groupEp, then aivNum; output out (allocated by the caller).
#include "wrappers.h"

namespace cam_jit_npu {

void e2a(const at::Tensor& expand_x, const at::Tensor& atten_batch_size, int64_t batch_size,
         int64_t hidden_size, int64_t topk, int64_t expert_rank_size,
         int64_t attention_rank_size, int64_t rank, std::string group_ep, int64_t aiv_num,
         const at::Tensor& out) {
  AclnnCall call("e2a", expand_x);
  auto* a_expand = call.tensor("expand_x", expand_x);
  auto* a_batches = call.tensor("atten_batch_size", atten_batch_size);
  auto* a_out = call.tensor("out", out);
  call.run(a_expand, a_batches, batch_size, hidden_size, topk, expert_rank_size,
           attention_rank_size, rank, const_cast<char*>(group_ep.c_str()), aiv_num, a_out);
}

}  // namespace cam_jit_npu
