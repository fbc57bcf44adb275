// torch op <ns>::fused_deep_moe -> aclnnFusedDeepMoe (docs/semantics.md §7.1, §7.2).
//
// The one aclnn name has three prototypes (docs/semantics.md §7.2, §8.1); `abi` says which one the
// installed package exports: 0 = base (SHMEM-capable: 14 inputs, groupEp + 8 int64 attributes
// ending with extInfo, shmemWorkspace, shmemWorkspaceSize), 1 = w4a8 (14 inputs + 2 bias lists +
// 2 optional biases, groupEp + 5 int64), 2 = master (14 inputs, groupEp + 5 int64). Python picks
// it (cam_jit.ascend.opp.detect_fdm_abi: op-info JSON, or CAM_JIT_FDM_ABI). Outputs are
// allocated by the caller: output and share_output [BS, H] x.dtype, expert_token_nums [E_loc]
// int64.
#include "wrappers.h"

namespace cam_jit_npu {

static constexpr int64_t kAbiBase = 0, kAbiW4a8 = 1, kAbiMaster = 2;

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
    const at::Tensor& expert_token_nums) {
  TORCH_CHECK(abi == kAbiBase || abi == kAbiW4a8 || abi == kAbiMaster,
              "cam_jit NPU op fused_deep_moe: abi must be 0 (base), 1 (w4a8) or 2 (master), got ",
              abi);
  AclnnCall call("fused_deep_moe", x);
  auto* a_x = call.tensor("x", x);
  auto* a_ids = call.tensor("expert_ids", expert_ids);
  auto* a_w1 = call.list("gmm1_weight", gmm1_weight);
  auto* a_s1 = call.list("gmm1_weight_scale", gmm1_weight_scale);
  auto* a_w2 = call.list("gmm2_weight", gmm2_weight);
  auto* a_s2 = call.list("gmm2_weight_scale", gmm2_weight_scale);
  auto* a_scales = call.tensor("expert_scales", expert_scales);
  auto* a_sw1 = call.optional("share_gmm1_weight", share_gmm1_weight);
  auto* a_ss1 = call.optional("share_gmm1_weight_scale", share_gmm1_weight_scale);
  auto* a_sw2 = call.optional("share_gmm2_weight", share_gmm2_weight);
  auto* a_ss2 = call.optional("share_gmm2_weight_scale", share_gmm2_weight_scale);
  auto* a_smooth = call.optional("expert_smooth_scales", expert_smooth_scales);
  auto* a_share_smooth = call.optional("share_smooth_scales", share_smooth_scales);
  auto* a_mask = call.optional("x_active_mask", x_active_mask);
  char* group = const_cast<char*>(group_ep.c_str());
  auto* a_out = call.tensor("output", output);
  auto* a_share_out = call.tensor("share_output", share_output);
  auto* a_nums = call.tensor("expert_token_nums", expert_token_nums);
  if (abi == kAbiW4a8) {
    auto* a_b1 = call.list("gmm1_bias", gmm1_bias);
    auto* a_b2 = call.list("gmm2_bias", gmm2_bias);
    auto* a_sb1 = call.optional("share_gmm1_bias", share_gmm1_bias);
    auto* a_sb2 = call.optional("share_gmm2_bias", share_gmm2_bias);
    call.run(a_x, a_ids, a_w1, a_s1, a_w2, a_s2, a_scales, a_sw1, a_ss1, a_sw2, a_ss2, a_smooth,
             a_share_smooth, a_mask, a_b1, a_b2, a_sb1, a_sb2, group, ep_rank_size, ep_rank_id,
             moe_expert_num, quant_mode, global_bs, a_out, a_share_out, a_nums);
    return;
  }
  TORCH_CHECK(gmm1_bias.empty() && gmm2_bias.empty() && !share_gmm1_bias.has_value() &&
                  !share_gmm2_bias.has_value(),
              "cam_jit NPU op fused_deep_moe: the installed ", abi == kAbiBase ? "base" : "master",
              " aclnnFusedDeepMoe takes no biases (they are W4A8 terms); install the W4A8 "
              "package or set CAM_JIT_FDM_ABI=w4a8 if it is installed");
  if (abi == kAbiBase) {
    call.run(a_x, a_ids, a_w1, a_s1, a_w2, a_s2, a_scales, a_sw1, a_ss1, a_sw2, a_ss2, a_smooth,
             a_share_smooth, a_mask, group, ep_rank_size, ep_rank_id, moe_expert_num, quant_mode,
             global_bs, ext_info, shmem_workspace, shmem_workspace_size, a_out, a_share_out,
             a_nums);
    return;
  }
  TORCH_CHECK(ext_info == 0 && shmem_workspace == 0 && shmem_workspace_size == 0,
              "cam_jit NPU op fused_deep_moe: the installed master aclnnFusedDeepMoe has no "
              "SHMEM attributes (ext_info, shmem_workspace, shmem_workspace_size must be 0)");
  call.run(a_x, a_ids, a_w1, a_s1, a_w2, a_s2, a_scales, a_sw1, a_ss1, a_sw2, a_ss2, a_smooth,
           a_share_smooth, a_mask, group, ep_rank_size, ep_rank_id, moe_expert_num, quant_mode,
           global_bs, a_out, a_share_out, a_nums);
}

}  // namespace cam_jit_npu
