// The aclnn wrappers, one per op (one .cpp file each); registration.cpp binds them to the private
// ops <CAM_JIT_NPU_NS>::<op>. Every wrapper takes the op's inputs, int64 attributes and
// caller-allocated outputs, and makes one aclnn call (aclnn_exec.h).
#pragma once

#include <string>

#include "aclnn_exec.h"

namespace cam_jit_npu {

void fused_deep_moe(
    const at::Tensor& x, const at::Tensor& expert_ids, at::TensorList gmm1_weight,
    at::TensorList gmm1_weight_scale, at::TensorList gmm2_weight,
    at::TensorList gmm2_weight_scale, const at::Tensor& expert_scales,
    const c10::optional<at::Tensor>& share_gmm1_weight,
    const c10::optional<at::Tensor>& share_gmm1_weight_scale,
    const c10::optional<at::Tensor>& share_gmm2_weight,
    const c10::optional<at::Tensor>& share_gmm2_weight_scale,
    const c10::optional<at::Tensor>& expert_smooth_scales,
    const c10::optional<at::Tensor>& share_smooth_scales,
    const c10::optional<at::Tensor>& x_active_mask, at::TensorList gmm1_bias,
    at::TensorList gmm2_bias, const c10::optional<at::Tensor>& share_gmm1_bias,
    const c10::optional<at::Tensor>& share_gmm2_bias, std::string group_ep, int64_t ep_rank_size,
    int64_t ep_rank_id, int64_t moe_expert_num, int64_t quant_mode, int64_t global_bs,
    int64_t abi, int64_t ext_info, int64_t shmem_workspace, int64_t shmem_workspace_size,
    const at::Tensor& output, const at::Tensor& share_output,
    const at::Tensor& expert_token_nums);

void a2e(const at::Tensor& x, const c10::optional<at::Tensor>& expert_ids,
         const c10::optional<at::Tensor>& scales, int64_t batch_size, int64_t hidden_size,
         int64_t topk, int64_t expert_rank_size, int64_t atten_rank_size, int64_t rank,
         std::string group_ep, int64_t aiv_num, int64_t compute_gate, const at::Tensor& expand_x,
         const at::Tensor& simulate_expert_ids, const at::Tensor& simulate_expert_scales,
         const at::Tensor& atten_batch_size, const at::Tensor& x_active_mask);

void e2a(const at::Tensor& expand_x, const at::Tensor& atten_batch_size, int64_t batch_size,
         int64_t hidden_size, int64_t topk, int64_t expert_rank_size,
         int64_t attention_rank_size, int64_t rank, std::string group_ep, int64_t aiv_num,
         const at::Tensor& out);

void all2_all_detour(const at::Tensor& send_data, const at::Tensor& comm_rank_ids,
                     const at::Tensor& comm_args, int64_t magic, const at::Tensor& out);

void reduce_scatter_detour(const at::Tensor& send_data, const at::Tensor& comm_rank_ids,
                           const at::Tensor& comm_args, int64_t magic, int64_t rank_size,
                           int64_t op, const at::Tensor& out);

void moe_dispatch_layout(const at::Tensor& topk_idx, int64_t num_tokens, int64_t num_ranks,
                         int64_t num_experts, int64_t num_topk, int64_t local_rank_size,
                         const at::Tensor& num_tokens_per_rank, const at::Tensor& num_tokens_per_expert,
                         const at::Tensor& is_token_in_rank, const at::Tensor& notify_send_data,
                         const at::Tensor& send_token_idx);

void moe_notify_dispatch(const at::Tensor& send_data, const at::Tensor& num_tokens_per_expert,
                         int64_t send_count, int64_t num_tokens, std::string group_ep, int64_t rank_size,
                         int64_t rank_id, int64_t local_rank_size, int64_t local_rank_id,
                         const at::Tensor& send_offset, const at::Tensor& recv_data,
                         const at::Tensor& total_recv_tokens, const at::Tensor& recv_count,
                         const at::Tensor& recv_offset, const at::Tensor& max_bs,
                         const at::Tensor& recv_tokens_per_expert);

void moe_dispatch_normal(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& send_offset,
                         const at::Tensor& send_token_idx, const at::Tensor& recv_offset,
                         const at::Tensor& recv_count, std::string group_ep, int64_t ep_world_size,
                         int64_t ep_rank_id, std::string group_tp, int64_t tp_world_size,
                         int64_t tp_rank_id, int64_t moe_expert_num, int64_t quant_mode, int64_t global_bs,
                         const at::Tensor& recv_x, const at::Tensor& recv_x_scales,
                         const at::Tensor& assist_info_for_combine);

void moe_combine_normal(const at::Tensor& recv_x, const at::Tensor& token_src_info,
                        const at::Tensor& ep_recv_counts, const at::Tensor& recv_topk_weights,
                        const at::Tensor& tp_recv_counts, std::string group_ep, int64_t ep_world_size,
                        int64_t ep_rank_id, std::string group_tp, int64_t tp_world_size, int64_t tp_rank_id,
                        int64_t moe_expert_num, int64_t global_bs, const at::Tensor& out);

}  // namespace cam_jit_npu
