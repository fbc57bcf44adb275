/* The stand-in SHMEM library behind shmem/include/shmem.h (see there). Each call appends one
 * JSON line to a log the test reads (sim_shmem_log); aclshmem_malloc hands out host memory, which
 * the executing stand-in kernel accepts as this PE's symmetric heap. A TLS-enabled bootstrap
 * without certificates fails, as SHMEM releases before Feb 2026 do. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmem.h"

static char g_log[1 << 14];
static size_t g_len = 0;
static bool g_tls = true;  /* SHMEM's default: TLS on */
static int g_status = ACLSHMEM_STATUS_NOT_INITIALIZED;
static long g_live = 0;

static void out(const char* line) {
  size_t n = strlen(line);
  if (g_len + n + 2 >= sizeof g_log) return;
  memcpy(g_log + g_len, line, n);
  g_len += n;
  g_log[g_len++] = '\n';
  g_log[g_len] = 0;
}

const char* sim_shmem_log(void) { return g_log; }
long sim_shmem_live(void) { return g_live; }
void sim_shmem_reset(void) { g_len = 0; g_log[0] = 0; g_tls = true; }

int32_t aclshmemx_set_conf_store_tls(bool enable, const char* tls_info, const uint32_t tls_info_len) {
  char line[512];
  snprintf(line, sizeof line, "{\"fn\":\"aclshmemx_set_conf_store_tls\",\"enable\":%d,\"info_null\":%d,\"len\":%u}",
           enable, tls_info == NULL, tls_info_len);
  out(line);
  g_tls = enable;
  return 0;
}

int aclshmemx_init_attr(int bootstrap_flags, aclshmemx_init_attr_t* a) {
  char line[512];
  snprintf(line, sizeof line,
           "{\"fn\":\"aclshmemx_init_attr\",\"flags\":%d,\"my_pe\":%d,\"n_pes\":%d,\"ip_port\":\"%s\",\"mem\":%llu}",
           bootstrap_flags, a->my_pe, a->n_pes, a->ip_port, (unsigned long long)a->local_mem_size);
  out(line);
  if (g_tls) return -1; /* the bootstrap asks for TLS certificates nobody configured */
  g_status = ACLSHMEM_STATUS_IS_INITIALIZED;
  return 0;
}

int aclshmemx_init_status(void) { return g_status; }

void* aclshmem_malloc(size_t size) {
  void* p = g_status == ACLSHMEM_STATUS_IS_INITIALIZED ? calloc(1, size) : NULL;
  char line[256];
  snprintf(line, sizeof line, "{\"fn\":\"aclshmem_malloc\",\"size\":%zu,\"ptr\":%llu}", size,
           (unsigned long long)(size_t)p);
  out(line);
  if (p) ++g_live;
  return p;
}

void aclshmem_free(void* ptr) {
  char line[256];
  snprintf(line, sizeof line, "{\"fn\":\"aclshmem_free\",\"ptr\":%llu}", (unsigned long long)(size_t)ptr);
  out(line);
  if (ptr) { free(ptr); --g_live; }
}

int aclshmem_finalize(void) {
  out("{\"fn\":\"aclshmem_finalize\"}");
  g_status = ACLSHMEM_STATUS_NOT_INITIALIZED;
  return 0;
}
