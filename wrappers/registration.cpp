// Registers the private ops of the wrapper library in namespace CAM_JIT_NPU_NS (_cam_jit_npu;
// the tests build it as _cam_jit_npu_test): `configure` and one op per wrapper. Outputs are
// caller-allocated mutable arguments; cam_jit/ascend/npu_ops.py is the only caller. The one
// translation unit that includes <torch/library.h> (it is the slowest header to compile).
#include <torch/library.h>

#include "wrappers.h"

namespace {

void configure(std::vector<std::string> libraries, std::vector<std::string> ops,
               std::vector<std::string> aclnn) {
  cam_jit_npu::configure_aclnn(libraries, ops, aclnn);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(CAM_JIT_NPU_NS, m) {
  m.def("configure(str[] libraries, str[] ops, str[] aclnn) -> ()", &configure);
  m.def(
      "fused_deep_moe(Tensor x, Tensor expert_ids, Tensor[] gmm1_weight, "
      "Tensor[] gmm1_weight_scale, Tensor[] gmm2_weight, Tensor[] gmm2_weight_scale, "
      "Tensor expert_scales, Tensor? share_gmm1_weight, Tensor? share_gmm1_weight_scale, "
      "Tensor? share_gmm2_weight, Tensor? share_gmm2_weight_scale, "
      "Tensor? expert_smooth_scales, Tensor? share_smooth_scales, Tensor? x_active_mask, "
      "Tensor[] gmm1_bias, Tensor[] gmm2_bias, Tensor? share_gmm1_bias, "
      "Tensor? share_gmm2_bias, str group_ep, int ep_rank_size, int ep_rank_id, "
      "int moe_expert_num, int quant_mode, int global_bs, int abi, int ext_info, "
      "int shmem_workspace, int shmem_workspace_size, Tensor(a!) output, "
      "Tensor(b!) share_output, Tensor(c!) expert_token_nums) -> ()",
      &cam_jit_npu::fused_deep_moe);
  m.def(
      "a2e(Tensor x, Tensor? expert_ids, Tensor? scales, int batch_size, int hidden_size, "
      "int topk, int expert_rank_size, int atten_rank_size, int rank, str group_ep, "
      "int aiv_num, int compute_gate, Tensor(a!) expand_x, Tensor(b!) simulate_expert_ids, "
      "Tensor(c!) simulate_expert_scales, Tensor(d!) atten_batch_size, "
      "Tensor(e!) x_active_mask) -> ()",
      &cam_jit_npu::a2e);
  m.def(
      "e2a(Tensor expand_x, Tensor atten_batch_size, int batch_size, int hidden_size, int topk, "
      "int expert_rank_size, int attention_rank_size, int rank, str group_ep, int aiv_num, "
      "Tensor(a!) out) -> ()",
      &cam_jit_npu::e2a);
  m.def(
      "all2_all_detour(Tensor sendData, Tensor commRankIds, Tensor commArgs, int magic, "
      "Tensor(a!) out) -> ()",
      &cam_jit_npu::all2_all_detour);
  m.def(
      "reduce_scatter_detour(Tensor sendData, Tensor commRankIds, Tensor commArgs, int magic, "
      "int rankSize, int op, Tensor(a!) out) -> ()",
      &cam_jit_npu::reduce_scatter_detour);
  m.def(
      "moe_dispatch_layout(Tensor topk_idx, int num_tokens, int num_ranks, int num_experts, "
      "int num_topk, int local_rank_size, Tensor(a!) num_tokens_per_rank, "
      "Tensor(b!) num_tokens_per_expert, Tensor(c!) is_token_in_rank, Tensor(d!) notify_send_data, "
      "Tensor(e!) send_token_idx) -> ()",
      &cam_jit_npu::moe_dispatch_layout);
  m.def(
      "moe_notify_dispatch(Tensor(a!) send_data, Tensor num_tokens_per_expert, int send_count, "
      "int num_tokens, str group_ep, int rank_size, int rank_id, int local_rank_size, "
      "int local_rank_id, Tensor(b!) send_offset, Tensor(c!) recv_data, "
      "Tensor(d!) total_recv_tokens, Tensor(e!) recv_count, Tensor(f!) recv_offset, "
      "Tensor(g!) max_bs, Tensor(h!) recv_tokens_per_expert) -> ()",
      &cam_jit_npu::moe_notify_dispatch);
  m.def(
      "moe_dispatch_normal(Tensor x, Tensor topk_idx, Tensor send_offset, Tensor send_token_idx, "
      "Tensor recv_offset, Tensor recv_count, str group_ep, int ep_world_size, int ep_rank_id, "
      "str group_tp, int tp_world_size, int tp_rank_id, int moe_expert_num, int quant_mode, "
      "int global_bs, Tensor(a!) recv_x, Tensor(b!) recv_x_scales, "
      "Tensor(c!) assist_info_for_combine) -> ()",
      &cam_jit_npu::moe_dispatch_normal);
  m.def(
      "moe_combine_normal(Tensor recv_x, Tensor token_src_info, Tensor ep_recv_counts, "
      "Tensor recv_topk_weights, Tensor tp_recv_counts, str group_ep, int ep_world_size, "
      "int ep_rank_id, str group_tp, int tp_world_size, int tp_rank_id, int moe_expert_num, "
      "int global_bs, Tensor(a!) out) -> ()",
      &cam_jit_npu::moe_combine_normal);
}
