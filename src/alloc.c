/* alloc.c — the library's host allocations, with the countdown that tests use
 * to fail them one site at a time (alloc.h). Depends on nothing else. */
#include "alloc.h"

#include <stdatomic.h>
#include <stdlib.h>

/* -1: no allocation fails; n >= 0: n more succeed, then all fail. */
static atomic_long fail_countdown = -1;
static atomic_long live;

int fmha_alloc_injected_failure(void)
{
    long n = atomic_load_explicit(&fail_countdown, memory_order_relaxed);
    while (n >= 0) {
        if (n == 0)
            return 1;
        if (atomic_compare_exchange_weak(&fail_countdown, &n, n - 1))
            return 0;
    }
    return 0;
}

static void *counted(void *p)
{
    if (p)
        atomic_fetch_add_explicit(&live, 1, memory_order_relaxed);
    return p;
}

void *fmha_malloc(size_t bytes)
{
    return fmha_alloc_injected_failure() ? NULL : counted(malloc(bytes ? bytes : 1));
}

void *fmha_calloc(size_t count, size_t size)
{
    return fmha_alloc_injected_failure() ? NULL
                                         : counted(calloc(count ? count : 1, size ? size : 1));
}

void *fmha_aligned_alloc(size_t align, size_t bytes)
{
    if (bytes > (size_t)-1 - align)
        return NULL;
    bytes = (bytes + align - 1) / align * align;
    return fmha_alloc_injected_failure() ? NULL
                                         : counted(aligned_alloc(align, bytes ? bytes : align));
}

void fmha_free(void *ptr)
{
    if (ptr) {
        atomic_fetch_sub_explicit(&live, 1, memory_order_relaxed);
        free(ptr);
    }
}

void fmha_alloc_fail_after(long n)
{
    atomic_store(&fail_countdown, n < 0 ? -1 : n);
}

long fmha_alloc_live(void)
{
    return atomic_load(&live);
}
