// torch ops <ns>::moe_dispatch_layout / moe_notify_dispatch / moe_dispatch_normal /
// moe_combine_normal -> UMDK master's aclnnDispatchLayout, aclnnNotifyDispatch,
// aclnnMoeDispatchNormal, aclnnMoeCombineNormal (op_api/aclnn_*.h; the call sequence of UMDK's
// pybind get_dispatch_layout.cpp, moe_dispatch_prefill.cpp and moe_combine_prefill.cpp). Inputs,
// then attributes (int64, char* group names), then outputs, all allocated by the caller
// (cam_jit/ascend/npu_ops.py), scratch outputs included. Absent optional outputs are null.
#include "wrappers.h"

namespace cam_jit_npu {

void moe_dispatch_layout(const at::Tensor& topk_idx, int64_t num_tokens, int64_t num_ranks,
                         int64_t num_experts, int64_t num_topk, int64_t local_rank_size,
                         const at::Tensor& num_tokens_per_rank, const at::Tensor& num_tokens_per_expert,
                         const at::Tensor& is_token_in_rank, const at::Tensor& notify_send_data,
                         const at::Tensor& send_token_idx) {
  AclnnCall call("moe_dispatch_layout", topk_idx);
  auto* a_idx = call.tensor("topk_idx", topk_idx);
  auto* a_rank = call.tensor("num_tokens_per_rank", num_tokens_per_rank);
  auto* a_expert = call.tensor("num_tokens_per_expert", num_tokens_per_expert);
  auto* a_in_rank = call.tensor("is_token_in_rank", is_token_in_rank);
  auto* a_scratch = call.tensor("notify_send_data", notify_send_data);
  auto* a_token_idx = call.tensor("send_token_idx", send_token_idx);
  call.run(a_idx, num_tokens, num_ranks, num_experts, num_topk, local_rank_size, a_rank, a_expert,
           a_in_rank, a_scratch, a_token_idx);
}

void moe_notify_dispatch(const at::Tensor& send_data, const at::Tensor& num_tokens_per_expert,
                         int64_t send_count, int64_t num_tokens, std::string group_ep, int64_t rank_size,
                         int64_t rank_id, int64_t local_rank_size, int64_t local_rank_id,
                         const at::Tensor& send_offset, const at::Tensor& recv_data,
                         const at::Tensor& total_recv_tokens, const at::Tensor& recv_count,
                         const at::Tensor& recv_offset, const at::Tensor& max_bs,
                         const at::Tensor& recv_tokens_per_expert) {
  AclnnCall call("moe_notify_dispatch", num_tokens_per_expert);
  auto* a_send = call.tensor("send_data", send_data);
  auto* a_counts = call.tensor("num_tokens_per_expert", num_tokens_per_expert);
  auto* a_offset = call.tensor("send_offset", send_offset);
  auto* a_recv = call.tensor("recv_data", recv_data);
  auto* a_total = call.tensor("total_recv_tokens", total_recv_tokens);
  auto* a_recv_count = call.tensor("recv_count", recv_count);
  auto* a_recv_offset = call.tensor("recv_offset", recv_offset);
  auto* a_max_bs = call.tensor("max_bs", max_bs);
  auto* a_per_expert = call.tensor("recv_tokens_per_expert", recv_tokens_per_expert);
  call.run(a_send, a_counts, send_count, num_tokens, const_cast<char*>(group_ep.c_str()), rank_size,
           rank_id, local_rank_size, local_rank_id, a_offset, a_recv, a_total, a_recv_count,
           a_recv_offset, a_max_bs, a_per_expert);
}

void moe_dispatch_normal(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& send_offset,
                         const at::Tensor& send_token_idx, const at::Tensor& recv_offset,
                         const at::Tensor& recv_count, std::string group_ep, int64_t ep_world_size,
                         int64_t ep_rank_id, std::string group_tp, int64_t tp_world_size,
                         int64_t tp_rank_id, int64_t moe_expert_num, int64_t quant_mode, int64_t global_bs,
                         const at::Tensor& recv_x, const at::Tensor& recv_x_scales,
                         const at::Tensor& assist_info_for_combine) {
  AclnnCall call("moe_dispatch_normal", x);
  auto* a_x = call.tensor("x", x);
  auto* a_idx = call.tensor("topk_idx", topk_idx);
  auto* a_send_offset = call.tensor("send_offset", send_offset);
  auto* a_token_idx = call.tensor("send_token_idx", send_token_idx);
  auto* a_recv_offset = call.tensor("recv_offset", recv_offset);
  auto* a_recv_count = call.tensor("recv_count", recv_count);
  auto* a_recv_x = call.tensor("recv_x", recv_x);
  auto* a_scales = call.tensor("recv_x_scales", recv_x_scales);
  auto* a_assist = call.tensor("assist_info_for_combine", assist_info_for_combine);
  const AclTensor* no_stats = nullptr;  // waitRecvCostStats: optional diagnostics output
  call.run(a_x, a_idx, a_send_offset, a_token_idx, a_recv_offset, a_recv_count,
           const_cast<char*>(group_ep.c_str()), ep_world_size, ep_rank_id,
           const_cast<char*>(group_tp.c_str()), tp_world_size, tp_rank_id, moe_expert_num, quant_mode,
           global_bs, a_recv_x, a_scales, a_assist, no_stats);
}

void moe_combine_normal(const at::Tensor& recv_x, const at::Tensor& token_src_info,
                        const at::Tensor& ep_recv_counts, const at::Tensor& recv_topk_weights,
                        const at::Tensor& tp_recv_counts, std::string group_ep, int64_t ep_world_size,
                        int64_t ep_rank_id, std::string group_tp, int64_t tp_world_size, int64_t tp_rank_id,
                        int64_t moe_expert_num, int64_t global_bs, const at::Tensor& out) {
  AclnnCall call("moe_combine_normal", recv_x);
  auto* a_recv_x = call.tensor("recv_x", recv_x);
  auto* a_src = call.tensor("token_src_info", token_src_info);
  auto* a_counts = call.tensor("ep_recv_counts", ep_recv_counts);
  auto* a_weights = call.tensor("recv_topk_weights", recv_topk_weights);
  auto* a_tp_counts = call.tensor("tp_recv_counts", tp_recv_counts);
  auto* a_out = call.tensor("out", out);
  const AclTensor* no_stats = nullptr;  // sendCostStats: optional diagnostics output
  call.run(a_recv_x, a_src, a_counts, a_weights, a_tp_counts, const_cast<char*>(group_ep.c_str()),
           ep_world_size, ep_rank_id, const_cast<char*>(group_tp.c_str()), tp_world_size, tp_rank_id,
           moe_expert_num, global_bs, a_out, no_stats);
}

}  // namespace cam_jit_npu
