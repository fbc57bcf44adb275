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
}
