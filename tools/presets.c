/* presets.c — the model shapes of shared/models.md. */
#include "presets.h"

#include <string.h>

static const fmha_preset presets[] = {
    {"wan2.1-14b-720p", "Wan 2.1/2.2 14B, 720p, 81 frames", 40, 40, 128, 75600, 75600, 0},
    {"wan2.1-14b-720p-97f", "Wan 14B, 720p, 97 frames", 40, 40, 128, 90000, 90000, 0},
    {"wan2.1-14b-480p", "Wan 14B, 480p, 81 frames", 40, 40, 128, 32760, 32760, 0},
    {"wan2.1-1.3b-480p", "Wan 2.1 1.3B, 480p", 12, 12, 128, 32760, 32760, 0},
    {"wan-cross", "Wan text cross-attention", 40, 40, 128, 32760, 512, 0},
    {"hunyuanvideo-720p", "HunyuanVideo, 720x1280, 129 frames", 24, 24, 128, 118800, 118800, 0},
    {"flux-1024", "Flux.1, 1024x1024", 24, 24, 128, 4608, 4608, 0},
    {"qwen-image-1328", "Qwen-Image, 1328x1328", 24, 24, 128, 6889, 6889, 0},
    {"z-image-1024", "Z-Image", 30, 30, 128, 4096, 4096, 0},
    {"lumina2", "Lumina-Image 2.0 (GQA)", 24, 8, 96, 4096, 4096, 0},
    {"minimax-h3", "MiniMax-H3", 56, 56, 128, 30272, 30272, 0},
    {"llama3-8b", "Llama-3 8B prefill (GQA, causal)", 32, 8, 128, 8192, 8192, 1},
};

const fmha_preset *fmha_preset_find(const char *name)
{
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (!strcmp(presets[i].name, name))
            return &presets[i];
    return NULL;
}

const fmha_preset *fmha_preset_at(int i)
{
    if (i < 0 || (size_t)i >= sizeof presets / sizeof presets[0])
        return NULL;
    return &presets[i];
}
