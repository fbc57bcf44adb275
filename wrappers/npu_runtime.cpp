// Device runtime hooks of the exec helper (aclnn_exec.h) on an Ascend NPU, from torch_npu: the
// current NPU stream, workspace from torch_npu's caching allocator (at::empty on the device),
// the NPU storage format of a tensor, and torch_npu's task queue (OpCommand::RunOpApiV2, what
// op-plugin's EXEC_NPU_CMD launches through). The only translation unit that includes torch_npu
// headers, and the place where our ACL constants are checked against the real ACL header.
#include "aclnn_exec.h"

#include <ATen/ATen.h>
#include <acl/acl_base.h>

#include "torch_npu/csrc/core/npu/NPUFormat.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

namespace cam_jit_npu {

static_assert(kAclFloat == ACL_FLOAT && kAclFloat16 == ACL_FLOAT16 && kAclInt8 == ACL_INT8 &&
                  kAclInt32 == ACL_INT32 && kAclUInt8 == ACL_UINT8 && kAclInt16 == ACL_INT16 &&
                  kAclInt64 == ACL_INT64 && kAclDouble == ACL_DOUBLE && kAclBool == ACL_BOOL &&
                  kAclBFloat16 == ACL_BF16,
              "cam_jit's aclDataType values differ from acl_base.h");
static_assert(kAclFormatND == ACL_FORMAT_ND && kAclFormatNC1HWC0 == ACL_FORMAT_NC1HWC0 &&
                  kAclFormatFractalNZ == ACL_FORMAT_FRACTAL_NZ,
              "cam_jit's aclFormat values differ from acl_base.h");
static_assert(sizeof(aclrtStream) == sizeof(void*), "aclrtStream is a pointer");

namespace {

// Formats whose storage is the plain strided layout: passed to aclnn as ND.
bool strided_format(int64_t format) {
  return format == ACL_FORMAT_NCHW || format == ACL_FORMAT_NHWC || format == ACL_FORMAT_ND ||
         format == ACL_FORMAT_NCDHW;
}

}  // namespace

void* current_stream(const at::Tensor& like) {
  return c10_npu::getCurrentNPUStream(like.device().index()).stream(false);
}

void enqueue(const std::string& name, std::function<int()> launch) {
  at_npu::native::OpCommand::RunOpApiV2(name, launch);
}

at::Tensor allocate_workspace(const at::Tensor& like, uint64_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

int32_t storage_format(const at::Tensor& t) {
  const int64_t format = at_npu::native::get_npu_format(t);
  return strided_format(format) ? kAclFormatND : static_cast<int32_t>(format);
}

std::vector<int64_t> storage_dims(const at::Tensor& t) {
  if (strided_format(at_npu::native::get_npu_format(t))) {
    return {static_cast<int64_t>(t.storage().nbytes() / t.element_size())};
  }
  return at_npu::native::get_npu_storage_sizes(t);
}

}  // namespace cam_jit_npu
