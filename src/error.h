/* error.h — the per-thread error slot behind fmha_last_error() (error.c).
 * Every part of the library reports failures here; it calls nothing. */
#ifndef FMHA_ERROR_H
#define FMHA_ERROR_H

#include "fmha.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records a formatted message for fmha_last_error() and returns `status`. */
fmha_status fmha_set_error(fmha_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void fmha_clear_error(void);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_ERROR_H */
