/* error.c — the error slot: one message per thread, set by whichever part of
 * the library fails and read by fmha_last_error(). Depends on nothing else. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[1024];

fmha_status fmha_set_error(fmha_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

void fmha_clear_error(void)
{
    last_error[0] = '\0';
}

const char *fmha_last_error(void)
{
    return last_error;
}

const char *fmha_status_string(fmha_status status)
{
    switch (status) {
    case FMHA_STATUS_OK: return "FMHA_STATUS_OK";
    case FMHA_STATUS_INVALID_ARGUMENT: return "FMHA_STATUS_INVALID_ARGUMENT";
    case FMHA_STATUS_UNSUPPORTED: return "FMHA_STATUS_UNSUPPORTED";
    case FMHA_STATUS_OUT_OF_MEMORY: return "FMHA_STATUS_OUT_OF_MEMORY";
    case FMHA_STATUS_BACKEND_ERROR: return "FMHA_STATUS_BACKEND_ERROR";
    }
    return "FMHA_STATUS_UNKNOWN";
}
