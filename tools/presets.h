/* presets.h — attention shapes of real models (shared/models.md), by name,
 * for `fmha run --model` and `fmha bench --model`. */
#ifndef FMHA_PRESETS_H
#define FMHA_PRESETS_H

#include <stdint.h>

typedef struct fmha_preset {
    const char *name;
    const char *model;
    int64_t heads, kv_heads, head_dim;
    int64_t seqlen_q, seqlen_k; /* typical self-attention tokens (q x k for cross-attention) */
    int causal;
} fmha_preset;

const fmha_preset *fmha_preset_find(const char *name);
const fmha_preset *fmha_preset_at(int i); /* NULL past the end */

#define FMHA_DEFAULT_PRESET "flux-1024"

#endif
