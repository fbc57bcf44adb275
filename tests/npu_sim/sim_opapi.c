/* A simulated aclnn library: the stand-in for a CANN vendor package's libcust_opapi.so (and for
 * the tensor API of CANN's libnnopbase.so) in tests that run without an NPU.
 *
 * It exports the aclnn tensor API (aclCreateTensor, aclCreateTensorList, aclDestroyTensor,
 * aclDestroyTensorList, aclDestroyAclOpExecutor, aclGetRecentErrMsg) and, for each operator,
 * aclnn<Op>GetWorkspaceSize and aclnn<Op> with the C prototypes of the vendor headers (op_api/
 * aclnn_*.h), written from them, independently of the wrappers. Every call appends one JSON line
 * to a log: each argument as a tensor (dtype, shape, strides, offset, format, storage dims, data
 * address), null, a tensor list (its tensors), an int64 or a string. Statuses and the workspace
 * size are chosen by the test (sim_set_status / sim_set_workspace).
 *
 * Executing: GetWorkspaceSize returns a fresh executor holding its JSON record; when a kernel
 * callback is set (sim_set_kernel), the launch hands it (aclnn name, record) and returns its
 * status, so the callback computes the outputs from nothing but the descriptors received
 * (tests/npu_sim/standin.py). Without one, nothing is computed.
 *
 * Build variants (macros): SIM_FDM_ABI = 0 base / 1 w4a8 / 2 master selects the one
 * aclnnFusedDeepMoe prototype exported; SIM_TENSOR_API_ONLY exports no operator at all;
 * SIM_NO_ERRMSG leaves out aclGetRecentErrMsg (CANN defines it in libascendcl, not the opapi);
 * SIM_ERRMSG_ONLY exports nothing but aclGetRecentErrMsg (a stand-in for libascendcl).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  int32_t dtype, format;
  uint64_t ndim, nstorage;
  int64_t dims[16], strides[16], storage[16], offset;
  void* data;
} SimTensor;
typedef struct { uint64_t n; const SimTensor** items; } SimList;
typedef int32_t Status;

static char* g_log = NULL;
static size_t g_len = 0, g_cap = 0;
static long g_live = 0; /* tensors + lists created and not destroyed */
static Status g_ws_status = 0, g_run_status = 0;
static uint64_t g_workspace = 0;
typedef int32_t (*SimKernel)(const char* aclnn, const char* record);
static SimKernel g_kernel = NULL;
#define EXECUTOR_MAGIC 0x5E5E
typedef struct { int magic; char* record; } SimExecutor;
static size_t g_record_start = 0;
static char g_error[2048];

static void out(const char* fmt, ...) {
  va_list ap;
  char buf[4096];
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof buf) n = (int)sizeof buf - 1;
  if (g_len + (size_t)n + 1 > g_cap) {
    g_cap = (g_len + (size_t)n + 1) * 2;
    g_log = (char*)realloc(g_log, g_cap);
  }
  memcpy(g_log + g_len, buf, (size_t)n + 1);
  g_len += (size_t)n;
}

/* ---- control, for the tests (ctypes) ---- */
void sim_reset(void) {
  g_len = 0; if (g_log) g_log[0] = 0;
  g_ws_status = g_run_status = 0; g_workspace = 0; g_error[0] = 0;
}
const char* sim_log(void) { return g_log ? g_log : ""; }
long sim_live_handles(void) { return g_live; }
void sim_set_status(Status workspace_status, Status run_status) { g_ws_status = workspace_status; g_run_status = run_status; }
void sim_set_workspace(uint64_t bytes) { g_workspace = bytes; }
void sim_set_kernel(SimKernel kernel) { g_kernel = kernel; }
void sim_set_error(const char* text) { snprintf(g_error, sizeof g_error, "%s", text ? text : ""); }

#ifndef SIM_NO_ERRMSG
const char* aclGetRecentErrMsg(void) {
  if (g_error[0]) return g_error;
  return g_ws_status || g_run_status ? "simulated failure" : "";
}
#endif
#ifndef SIM_ERRMSG_ONLY

/* ---- the aclnn tensor API ---- */
void* aclCreateTensor(const int64_t* view_dims, uint64_t ndim, int32_t dtype, const int64_t* strides,
                      int64_t offset, int32_t format, const int64_t* storage_dims, uint64_t nstorage,
                      void* data) {
  if (ndim > 16 || nstorage > 16) return NULL;
  SimTensor* t = (SimTensor*)calloc(1, sizeof(SimTensor));
  t->dtype = dtype; t->format = format; t->ndim = ndim; t->nstorage = nstorage;
  t->offset = offset; t->data = data;
  for (uint64_t i = 0; i < ndim; ++i) { t->dims[i] = view_dims[i]; t->strides[i] = strides[i]; }
  for (uint64_t i = 0; i < nstorage; ++i) t->storage[i] = storage_dims[i];
  ++g_live;
  return t;
}
void* aclCreateTensorList(const void* const* tensors, uint64_t n) {
  SimList* l = (SimList*)calloc(1, sizeof(SimList));
  l->n = n;
  l->items = (const SimTensor**)calloc(n ? n : 1, sizeof(SimTensor*));
  for (uint64_t i = 0; i < n; ++i) l->items[i] = (const SimTensor*)tensors[i];
  ++g_live;
  return l;
}
Status aclDestroyTensor(const void* t) { if (t) { free((void*)t); --g_live; } return 0; }
Status aclDestroyTensorList(const void* p) {
  const SimList* l = (const SimList*)p;
  if (!l) return 0;
  for (uint64_t i = 0; i < l->n; ++i) aclDestroyTensor(l->items[i]);
  free((void*)l->items); free((void*)l); --g_live;
  return 0;
}
static int executor_ok(const void* e) { return e && ((const SimExecutor*)e)->magic == EXECUTOR_MAGIC; }
static void free_executor(void* e) {
  if (!executor_ok(e)) return;
  SimExecutor* x = (SimExecutor*)e;
  x->magic = 0; free(x->record); free(x); --g_live;
}
Status aclDestroyAclOpExecutor(void* executor) {
  out("{\"fn\":\"aclDestroyAclOpExecutor\",\"executor_ok\":%d}\n", executor_ok(executor));
  free_executor(executor);
  return 0;
}

/* ---- argument recording ---- */
static void ints(const char* key, const int64_t* v, uint64_t n) {
  out("\"%s\":[", key);
  for (uint64_t i = 0; i < n; ++i) out(i ? ",%lld" : "%lld", (long long)v[i]);
  out("]");
}
static void tensor_json(const SimTensor* t) {
  if (!t) { out("null"); return; }
  out("{\"kind\":\"tensor\",\"dtype\":%d,\"format\":%d,\"offset\":%lld,\"data\":%llu,",
      t->dtype, t->format, (long long)t->offset, (unsigned long long)(uintptr_t)t->data);
  ints("shape", t->dims, t->ndim); out(",");
  ints("strides", t->strides, t->ndim); out(",");
  ints("storage", t->storage, t->nstorage); out("}");
}
static int g_first;
static void sep(void) { out(g_first ? "" : ","); g_first = 0; }
static void T(const void* t) { sep(); tensor_json((const SimTensor*)t); }
static void L(const void* p) {
  const SimList* l = (const SimList*)p;
  sep();
  if (!l) { out("null"); return; }
  out("{\"kind\":\"list\",\"items\":[");
  for (uint64_t i = 0; i < l->n; ++i) { if (i) out(","); tensor_json(l->items[i]); }
  out("]}");
}
static void I(int64_t v) { sep(); out("{\"kind\":\"int\",\"value\":%lld}", (long long)v); }
static void S(const char* s) {
  sep();
  out("{\"kind\":\"str\",\"value\":\"");
  for (; s && *s; ++s) out(*s == '"' || *s == '\\' ? "\\%c" : "%c", *s);
  out("\"}");
}
static void begin(const char* fn) {
  g_record_start = g_len;
  out("{\"fn\":\"%s\",\"args\":[", fn);
  g_first = 1;
}
static Status end_ws(uint64_t* ws, void** executor) {
  out("]}\n");
  *ws = g_workspace;
  *executor = NULL;
  if (g_ws_status) return g_ws_status;
  SimExecutor* x = (SimExecutor*)calloc(1, sizeof(SimExecutor));
  x->magic = EXECUTOR_MAGIC;
  x->record = strdup(g_log + g_record_start);
  ++g_live;
  *executor = x;
  return 0;
}
static Status launch(const char* fn, void* workspace, uint64_t size, void* executor, void* stream) {
  int ok = executor_ok(executor);
  out("{\"fn\":\"%s\",\"workspace_null\":%d,\"workspace_size\":%llu,\"executor_ok\":%d,\"stream\":%llu}\n",
      fn, workspace == NULL, (unsigned long long)size, ok, (unsigned long long)(uintptr_t)stream);
  Status status = g_run_status;
  if (status == 0 && ok && g_kernel) status = g_kernel(fn, ((SimExecutor*)executor)->record);
  free_executor(executor);
  return status;
}
#define LAUNCH(name) \
  Status name(void* w, uint64_t s, void* e, void* st) { return launch(#name, w, s, e, st); }

typedef const void* Tn;  /* const aclTensor* */
typedef const void* Ls;  /* const aclTensorList* */

#ifndef SIM_TENSOR_API_ONLY
#ifndef SIM_FDM_ABI
#define SIM_FDM_ABI 0
#endif
#if SIM_FDM_ABI == 0  /* base, SHMEM-capable */
Status aclnnFusedDeepMoeGetWorkspaceSize(Tn x, Tn ids, Ls w1, Ls s1, Ls w2, Ls s2, Tn scales, Tn sw1,
    Tn ss1, Tn sw2, Tn ss2, Tn smooth, Tn share_smooth, Tn mask, char* group, int64_t ranks,
    int64_t rank, int64_t experts, int64_t quant, int64_t gbs, int64_t ext_info, int64_t shmem,
    int64_t shmem_size, Tn output, Tn share_output, Tn nums, uint64_t* ws, void** ex) {
  begin("aclnnFusedDeepMoeGetWorkspaceSize");
  T(x); T(ids); L(w1); L(s1); L(w2); L(s2); T(scales); T(sw1); T(ss1); T(sw2); T(ss2); T(smooth);
  T(share_smooth); T(mask); S(group); I(ranks); I(rank); I(experts); I(quant); I(gbs); I(ext_info);
  I(shmem); I(shmem_size); T(output); T(share_output); T(nums);
  return end_ws(ws, ex);
}
#elif SIM_FDM_ABI == 1  /* w4a8 */
Status aclnnFusedDeepMoeGetWorkspaceSize(Tn x, Tn ids, Ls w1, Ls s1, Ls w2, Ls s2, Tn scales, Tn sw1,
    Tn ss1, Tn sw2, Tn ss2, Tn smooth, Tn share_smooth, Tn mask, Ls b1, Ls b2, Tn sb1, Tn sb2,
    char* group, int64_t ranks, int64_t rank, int64_t experts, int64_t quant, int64_t gbs,
    Tn output, Tn share_output, Tn nums, uint64_t* ws, void** ex) {
  begin("aclnnFusedDeepMoeGetWorkspaceSize");
  T(x); T(ids); L(w1); L(s1); L(w2); L(s2); T(scales); T(sw1); T(ss1); T(sw2); T(ss2); T(smooth);
  T(share_smooth); T(mask); L(b1); L(b2); T(sb1); T(sb2); S(group); I(ranks); I(rank); I(experts);
  I(quant); I(gbs); T(output); T(share_output); T(nums);
  return end_ws(ws, ex);
}
#else  /* master */
Status aclnnFusedDeepMoeGetWorkspaceSize(Tn x, Tn ids, Ls w1, Ls s1, Ls w2, Ls s2, Tn scales, Tn sw1,
    Tn ss1, Tn sw2, Tn ss2, Tn smooth, Tn share_smooth, Tn mask, char* group, int64_t ranks,
    int64_t rank, int64_t experts, int64_t quant, int64_t gbs, Tn output, Tn share_output, Tn nums,
    uint64_t* ws, void** ex) {
  begin("aclnnFusedDeepMoeGetWorkspaceSize");
  T(x); T(ids); L(w1); L(s1); L(w2); L(s2); T(scales); T(sw1); T(ss1); T(sw2); T(ss2); T(smooth);
  T(share_smooth); T(mask); S(group); I(ranks); I(rank); I(experts); I(quant); I(gbs);
  T(output); T(share_output); T(nums);
  return end_ws(ws, ex);
}
#endif
LAUNCH(aclnnFusedDeepMoe)

Status aclnnA2eGetWorkspaceSize(Tn x, Tn ids, Tn scales, int64_t batch, int64_t hidden, int64_t topk,
    int64_t er, int64_t ar, int64_t rank, char* group, int64_t aiv, int64_t gate, Tn expand_x,
    Tn sim_ids, Tn sim_scales, Tn batches, Tn mask, uint64_t* ws, void** ex) {
  begin("aclnnA2eGetWorkspaceSize");
  T(x); T(ids); T(scales); I(batch); I(hidden); I(topk); I(er); I(ar); I(rank); S(group); I(aiv);
  I(gate); T(expand_x); T(sim_ids); T(sim_scales); T(batches); T(mask);
  return end_ws(ws, ex);
}
LAUNCH(aclnnA2e)

Status aclnnE2aGetWorkspaceSize(Tn expand_x, Tn batches, int64_t batch, int64_t hidden, int64_t topk,
    int64_t er, int64_t ar, int64_t rank, char* group, int64_t aiv, Tn out_, uint64_t* ws, void** ex) {
  begin("aclnnE2aGetWorkspaceSize");
  T(expand_x); T(batches); I(batch); I(hidden); I(topk); I(er); I(ar); I(rank); S(group); I(aiv);
  T(out_);
  return end_ws(ws, ex);
}
LAUNCH(aclnnE2a)

Status aclnnAll2AllDetourGetWorkspaceSize(Tn send, Tn ids, Tn args, int64_t magic, Tn out_,
    uint64_t* ws, void** ex) {
  begin("aclnnAll2AllDetourGetWorkspaceSize");
  T(send); T(ids); T(args); I(magic); T(out_);
  return end_ws(ws, ex);
}
LAUNCH(aclnnAll2AllDetour)

Status aclnnReduceScatterDetourGetWorkspaceSize(Tn send, Tn ids, Tn args, int64_t magic,
    int64_t rank_size, int64_t op, Tn out_, uint64_t* ws, void** ex) {
  begin("aclnnReduceScatterDetourGetWorkspaceSize");
  T(send); T(ids); T(args); I(magic); I(rank_size); I(op); T(out_);
  return end_ws(ws, ex);
}
LAUNCH(aclnnReduceScatterDetour)

/* UMDK master's prefill kernels (op_api/aclnn_dispatch_layout.h, aclnn_notify_dispatch.h,
 * aclnn_moe_dispatch_normal.h, aclnn_moe_combine_normal.h) */
Status aclnnDispatchLayoutGetWorkspaceSize(Tn topk, int64_t tokens, int64_t ranks, int64_t experts,
    int64_t k, int64_t local_ranks, Tn per_rank, Tn per_expert, Tn in_rank, Tn scratch, Tn token_idx,
    uint64_t* ws, void** ex) {
  begin("aclnnDispatchLayoutGetWorkspaceSize");
  T(topk); I(tokens); I(ranks); I(experts); I(k); I(local_ranks); T(per_rank); T(per_expert); T(in_rank);
  T(scratch); T(token_idx);
  return end_ws(ws, ex);
}
LAUNCH(aclnnDispatchLayout)

Status aclnnNotifyDispatchGetWorkspaceSize(Tn send_data, Tn per_expert, int64_t send_count, int64_t tokens,
    char* group, int64_t ranks, int64_t rank, int64_t local_ranks, int64_t local_rank, Tn send_offset,
    Tn recv_data, Tn total, Tn recv_count, Tn recv_offset, Tn max_bs, Tn recv_per_expert, uint64_t* ws,
    void** ex) {
  begin("aclnnNotifyDispatchGetWorkspaceSize");
  T(send_data); T(per_expert); I(send_count); I(tokens); S(group); I(ranks); I(rank); I(local_ranks);
  I(local_rank); T(send_offset); T(recv_data); T(total); T(recv_count); T(recv_offset); T(max_bs);
  T(recv_per_expert);
  return end_ws(ws, ex);
}
LAUNCH(aclnnNotifyDispatch)

Status aclnnMoeDispatchNormalGetWorkspaceSize(Tn x, Tn topk, Tn send_offset, Tn token_idx, Tn recv_offset,
    Tn recv_count, char* group_ep, int64_t ranks, int64_t rank, char* group_tp, int64_t tp_size,
    int64_t tp_rank, int64_t experts, int64_t quant, int64_t gbs, Tn recv_x, Tn scales, Tn assist,
    Tn stats, uint64_t* ws, void** ex) {
  begin("aclnnMoeDispatchNormalGetWorkspaceSize");
  T(x); T(topk); T(send_offset); T(token_idx); T(recv_offset); T(recv_count); S(group_ep); I(ranks);
  I(rank); S(group_tp); I(tp_size); I(tp_rank); I(experts); I(quant); I(gbs); T(recv_x); T(scales);
  T(assist); T(stats);
  return end_ws(ws, ex);
}
LAUNCH(aclnnMoeDispatchNormal)

Status aclnnMoeCombineNormalGetWorkspaceSize(Tn recv_x, Tn src_info, Tn recv_counts, Tn weights,
    Tn tp_counts, char* group_ep, int64_t ranks, int64_t rank, char* group_tp, int64_t tp_size,
    int64_t tp_rank, int64_t experts, int64_t gbs, Tn out_, Tn stats, uint64_t* ws, void** ex) {
  begin("aclnnMoeCombineNormalGetWorkspaceSize");
  T(recv_x); T(src_info); T(recv_counts); T(weights); T(tp_counts); S(group_ep); I(ranks); I(rank);
  S(group_tp); I(tp_size); I(tp_rank); I(experts); I(gbs); T(out_); T(stats);
  return end_ws(ws, ex);
}
LAUNCH(aclnnMoeCombineNormal)
#endif
#endif  /* SIM_ERRMSG_ONLY */
