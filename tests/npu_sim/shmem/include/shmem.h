/* A stand-in for Ascend SHMEM's host API header (shmem.h), for tests without an NPU: the names,
 * types and constants cam_jit's wrappers/zb_shmem.cpp uses, declared from SHMEM's documented host
 * API (aclshmemx_set_conf_store_tls, aclshmemx_init_attr with its attribute struct and bootstrap
 * flag, aclshmemx_init_status, aclshmem_malloc / aclshmem_free / aclshmem_finalize). Implemented
 * by sim_shmem.c, which records every call and allocates the "symmetric heap" from host memory. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

enum { ACLSHMEMX_INIT_WITH_DEFAULT = 1 << 2 };
enum { ACLSHMEM_STATUS_NOT_INITIALIZED = 0, ACLSHMEM_STATUS_SHM_CREATED, ACLSHMEM_STATUS_IS_INITIALIZED };

typedef struct {
  int version;
  int data_op_engine_type;
  uint32_t timeouts[3];
  int32_t sock_fd;
} aclshmem_init_optional_attr_t;

typedef struct aclshmemx_init_attr_t {
  int my_pe;
  int n_pes;
  char ip_port[64];
  uint64_t local_mem_size;
  aclshmem_init_optional_attr_t option_attr;
  void* comm_args;
  uint64_t instance_id;
} aclshmemx_init_attr_t;

int32_t aclshmemx_set_conf_store_tls(bool enable, const char* tls_info, const uint32_t tls_info_len);
int aclshmemx_init_attr(int bootstrap_flags, aclshmemx_init_attr_t* attributes);
int aclshmemx_init_status(void);
void* aclshmem_malloc(size_t size);
void aclshmem_free(void* ptr);
int aclshmem_finalize(void);

#ifdef __cplusplus
}
#endif
