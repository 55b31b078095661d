/* sp_plan.h — the cost model of sequence parallelism behind `fmha sp-plan`
 * (sp_plan.c): the time of each split ulysses x ring of a device count,
 * from the shape, the links and the kernel's speed. The formulas are
 * docs/sequence_parallel.md's; nothing here prints or exits except
 * sp_plan_main, the command. */
#ifndef FMHA_TOOLS_SP_PLAN_H
#define FMHA_TOOLS_SP_PLAN_H

#include <stdint.h>

typedef struct sp_machine {
    int gpus_per_node;
    double nvlink_gbs;               /* NVLink, GB/s per GPU, both directions together */
    double ib_gbps;                  /* InfiniBand, Gbit/s per GPU, each direction */
    double tflops;                   /* the attention kernel, dense TFLOP/s */
    double hbm_tbs;                  /* HBM, TB/s (the merges) */
    double merge_eff;                /* the merge kernel: achieved / HBM bandwidth */
    double a2a_eff;                  /* all-to-all: achieved / link bandwidth */
    double p2p_eff;                  /* ring send/recv: achieved / link bandwidth */
    double nvlink_lat_us, ib_lat_us; /* per exchange */
} sp_machine;

typedef struct sp_shape {
    int64_t batch, seqlen, text, heads, kv_heads, head_dim, elem_bytes;
    int causal;
} sp_shape;

/* One split's prediction, in milliseconds. */
typedef struct sp_estimate {
    int u, r;
    int valid;               /* the heads allow this ulysses degree */
    double t1;               /* one device */
    double compute;          /* attention per rank */
    double ulysses;          /* both all-to-alls */
    double ring_step_x;      /* one ring step's transfer */
    double ring_step_c;      /* one ring step's attention + merge */
    double merge;            /* all merges */
    double total;            /* the call */
    double efficiency;       /* t1 / (devices x total) */
    int ulysses_ib, ring_ib; /* their traffic crosses nodes */
} sp_estimate;

void sp_machine_defaults(sp_machine *m);
sp_estimate sp_estimate_split(const sp_shape *s, const sp_machine *m, int u, int r);

int sp_plan_main(int argc, char **argv);

#endif
