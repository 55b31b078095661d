/* peak.h — the machine's arithmetic ceilings, measured, so that benchmarks
 * report a fraction of this machine's peak rather than a datasheet's. */
#ifndef FMHA_PEAK_H
#define FMHA_PEAK_H

/* GFLOP/s of f32 FMA on `threads` threads (an FMA counts 2 FLOPs), with the
 * widest vectors this CPU runs. */
double fmha_peak_f32_gflops(int threads);
/* GFLOP/s of vdpbf16ps (each lane: 2 products + 2 adds = 4 FLOPs); 0 when the
 * CPU lacks AVX512_BF16. */
double fmha_peak_bf16_gflops(int threads);

#endif
