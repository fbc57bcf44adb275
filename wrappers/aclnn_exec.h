// cam_jit's aclnn execution helper: resolve an operator's two entry points with dlsym, turn
// at::Tensor / optional / tensor lists / int64 / strings into ACL handles, get the workspace size
// and allocate the workspace on the calling thread, then hand the launch and the release of every
// handle to the device's task queue, as op-plugin's EXEC_NPU_CMD does (docs/semantics.md §7.1). Every handle
// is released on every path.
//
// Nothing here includes a torch_npu or CANN header. The few ACL facts needed (enum values, the
// aclnn tensor-API prototypes, which the torch_npu wheel does not ship) are declared below and
// resolved at run time from the libraries Python configured (configure_aclnn()). What depends on
// the device runtime (stream, workspace allocation, NPU storage format, task queue) is the five
// functions of "device runtime hooks", defined by exactly one translation unit per build:
// npu_runtime.cpp on an NPU, the test runtime of tests/npu_sim when the helper is driven with CPU
// tensors.
//
// Errors are c10::Error (TORCH_CHECK), i.e. a Python RuntimeError that names the op, the aclnn
// function, the status and the libraries searched.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

// The private op namespace this library registers into (set by the build: _cam_jit_npu, or the
// test namespace); the ops are called by cam_jit/ascend/npu_ops.py only.
#ifndef CAM_JIT_NPU_NS
#define CAM_JIT_NPU_NS _cam_jit_npu
#endif

namespace cam_jit_npu {

// aclDataType / aclFormat values (CANN acl_base.h; npu_runtime.cpp static_asserts them against
// the real header).
enum AclDtype : int32_t {
  kAclFloat = 0, kAclFloat16 = 1, kAclInt8 = 2, kAclInt32 = 3, kAclUInt8 = 4, kAclInt16 = 6,
  kAclInt64 = 9, kAclDouble = 11, kAclBool = 12, kAclBFloat16 = 27,
};
enum AclFormat : int32_t { kAclFormatND = 2, kAclFormatNC1HWC0 = 3, kAclFormatFractalNZ = 29 };

// Opaque ACL handle types (defined by CANN; only pointers are used).
struct AclTensor;
struct AclTensorList;
struct AclOpExecutor;
using AclStatus = int32_t;  // aclnnStatus; 0 is success

// The aclnn tensor API (CANN aclnn/acl_meta.h), as function-pointer types.
using CreateTensorFn = AclTensor* (*)(const int64_t* view_dims, uint64_t view_dims_num,
                                      int32_t data_type, const int64_t* strides, int64_t offset,
                                      int32_t format, const int64_t* storage_dims,
                                      uint64_t storage_dims_num, void* data);
using CreateTensorListFn = AclTensorList* (*)(const AclTensor* const* tensors, uint64_t size);
using DestroyTensorFn = AclStatus (*)(const AclTensor* tensor);
using DestroyTensorListFn = AclStatus (*)(const AclTensorList* list);  // frees its tensors too
using RecentErrMsgFn = const char* (*)();
using DestroyExecutorFn = AclStatus (*)(AclOpExecutor* executor);  // for a launch never made
// Second phase of every operator: aclnnX(workspace, workspaceSize, executor, stream).
using LaunchFn = AclStatus (*)(void* workspace, uint64_t workspace_size, AclOpExecutor* executor,
                               void* stream);

// ---- device runtime hooks (one definition per build) ----
// The current stream of `like`'s device, as the aclrtStream the launch takes (without draining
// the task queue: the launch is queued behind the ops already queued).
void* current_stream(const at::Tensor& like);
// Queues `launch` (the aclnn launch, then the release of the call's handles) on the task queue
// of the current device: it runs in order with the ops queued before and after it. `name` is the
// aclnn function, for the queue's profiler and error reports. A non-zero return or an exception
// is an error of the launch.
void enqueue(const std::string& name, std::function<int()> launch);
// A workspace of `bytes` on `like`'s device from the caching allocator (kept alive by the caller
// until the launch is enqueued).
at::Tensor allocate_workspace(const at::Tensor& like, uint64_t bytes);
// The tensor's storage format (ND or FRACTAL_NZ, ...) and the storage dims that go with it.
int32_t storage_format(const at::Tensor& t);
std::vector<int64_t> storage_dims(const at::Tensor& t);

// ---- configuration (from Python, once per process) ----
// `libraries`: search order (vendor libcust_opapi.so files, CANN's libopapi.so, then the library
// holding the tensor API); `ops[i]` is served by aclnn entry point stem `aclnn[i]`.
void configure_aclnn(const std::vector<std::string>& libraries,
                     const std::vector<std::string>& ops, const std::vector<std::string>& aclnn);

// The ACL type of a torch dtype; TORCH_CHECK failure naming op and argument otherwise.
int32_t acl_dtype(const std::string& op, const std::string& arg, c10::ScalarType dtype);

// One aclnn call of op `op`. Convert arguments with tensor()/optional()/list(), then run().
// Every handle created is destroyed by the destructor, whatever happens in between.
class AclnnCall {
 public:
  AclnnCall(std::string op, const at::Tensor& device_like);
  ~AclnnCall();
  AclnnCall(const AclnnCall&) = delete;
  AclnnCall& operator=(const AclnnCall&) = delete;

  const AclTensor* tensor(const std::string& arg, const at::Tensor& t);
  const AclTensor* optional(const std::string& arg, const c10::optional<at::Tensor>& t);
  const AclTensorList* list(const std::string& arg, at::TensorList ts);

  // aclnnXGetWorkspaceSize(args..., &size, &executor) and the workspace on this thread, then
  // aclnnX(workspace, size, executor, stream) and the handles' release on the task queue.
  // Every integer attribute must be int64_t (docs/semantics.md §7.1): narrower ints do not compile.
  template <typename... Args>
  void run(Args... args) {
    static_assert(((!std::is_integral<Args>::value || std::is_same<Args, int64_t>::value ||
                    std::is_same<Args, uint64_t>::value) && ...),
                  "aclnn integer attributes are int64_t (or uint64_t for addresses)");
    using WorkspaceFn = AclStatus (*)(Args..., uint64_t*, AclOpExecutor**);
    resolve();
    uint64_t workspace_size = 0;
    AclOpExecutor* executor = nullptr;
    check(reinterpret_cast<WorkspaceFn>(get_workspace_)(args..., &workspace_size, &executor),
          aclnn_ + "GetWorkspaceSize");
    launch(workspace_size, executor);
  }

 private:
  // The ACL handles of one call; destroyed by release() or, at the latest, the destructor.
  struct Handles {
    std::vector<AclTensor*> tensors;    // owned directly
    std::vector<AclTensorList*> lists;  // own their element tensors
    void release();
    ~Handles() { release(); }
  };

  void resolve();
  void launch(uint64_t workspace_size, AclOpExecutor* executor);
  void check(AclStatus status, const std::string& function);
  AclTensor* make(const std::string& arg, const at::Tensor& t);

  std::string op_;
  at::Tensor like_;
  std::string aclnn_;
  std::string library_;  // where the entry points were found
  void* get_workspace_ = nullptr;
  LaunchFn launch_ = nullptr;
  std::shared_ptr<Handles> handles_ = std::make_shared<Handles>();  // moved to the queued launch
};

}  // namespace cam_jit_npu
