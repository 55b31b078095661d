/* alloc.h — every host allocation of the library goes through here (alloc.c),
 * so that a test can make any one of them fail and count what is still live:
 * the library must answer each failure with FMHA_STATUS_OUT_OF_MEMORY, leak
 * nothing and write nothing. Device allocators ask fmha_alloc_injected_failure
 * first, so that the same countdown reaches them. */
#ifndef FMHA_ALLOC_H
#define FMHA_ALLOC_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

void *fmha_malloc(size_t bytes);
void *fmha_calloc(size_t count, size_t size);
/* `bytes` rounded up to a multiple of `align` here (aligned_alloc needs it). */
void *fmha_aligned_alloc(size_t align, size_t bytes);
void fmha_free(void *ptr);

/* 1 when the countdown says this allocation fails (and counts it as one). */
int fmha_alloc_injected_failure(void);

/* Fault injection for tests, process-wide: the next `n` allocations succeed
 * and every later one fails, until fmha_alloc_fail_after(-1) (the default:
 * none fails). Not for concurrent use with other calls of the library. */
void fmha_alloc_fail_after(long n);
/* Host allocations made here and not yet freed. */
long fmha_alloc_live(void);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_ALLOC_H */
