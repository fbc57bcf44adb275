// torch op <ns>::a2e -> aclnnA2e (docs/semantics.md §2, §7.2): inputs x, expertIds?, scales?; int64
// attributes batchSize, hiddenSize, topk, expertRankSize, attentionRankSize, rank, then
// char* groupEp, then aivNum, computeGate; outputs expandXOut, simulateExpertIdsOut,
// simulateExpertScalesOut, attenBatchSize, xActiveMaskOut (allocated by the caller).
#include "wrappers.h"

namespace cam_jit_npu {

void a2e(const at::Tensor& x, const c10::optional<at::Tensor>& expert_ids,
         const c10::optional<at::Tensor>& scales, int64_t batch_size, int64_t hidden_size,
         int64_t topk, int64_t expert_rank_size, int64_t atten_rank_size, int64_t rank,
         std::string group_ep, int64_t aiv_num, int64_t compute_gate, const at::Tensor& expand_x,
         const at::Tensor& simulate_expert_ids, const at::Tensor& simulate_expert_scales,
         const at::Tensor& atten_batch_size, const at::Tensor& x_active_mask) {
  AclnnCall call("a2e", x);
  auto* a_x = call.tensor("x", x);
  auto* a_ids = call.optional("expert_ids", expert_ids);
  auto* a_scales = call.optional("scales", scales);
  auto* a_expand = call.tensor("expand_x", expand_x);
  auto* a_sim_ids = call.tensor("simulate_expert_ids", simulate_expert_ids);
  auto* a_sim_scales = call.tensor("simulate_expert_scales", simulate_expert_scales);
  auto* a_batches = call.tensor("atten_batch_size", atten_batch_size);
  auto* a_mask = call.tensor("x_active_mask", x_active_mask);
  call.run(a_x, a_ids, a_scales, batch_size, hidden_size, topk, expert_rank_size,
           atten_rank_size, rank, const_cast<char*>(group_ep.c_str()), aiv_num, compute_gate,
           a_expand, a_sim_ids, a_sim_scales, a_batches, a_mask);
}

}  // namespace cam_jit_npu
