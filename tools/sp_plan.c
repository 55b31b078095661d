/* sp_plan.c — `fmha sp-plan`: predicts the time of sequence-parallel
 * attention for each split ulysses x ring of the devices and names the best
 * (docs/sequence_parallel.md, "Cost model", has the formulas and where the
 * defaults come from). */
#include "sp_plan.h"

#include "fmha.h"
#include "presets.h"

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sp_machine_defaults(sp_machine *m)
{
    m->gpus_per_node = 8;
    m->nvlink_gbs = 900.0; /* H200 NVLink 4: 18 links, 900 GB/s per GPU both ways */
    m->ib_gbps = 400.0;    /* one 400 Gb/s NDR NIC per GPU */
    m->tflops = 634.8;     /* bench/RESULTS.md: fmha bf16 on an H200, wan14b_720p */
    m->hbm_tbs = 4.8;      /* H200 HBM3e */
    m->merge_eff = 0.8;    /* bench/RESULTS.md: sp_step_cuda on an H100, 0.80 of 3.35 TB/s */
    m->a2a_eff = 0.8;
    m->p2p_eff = 0.9;
    m->nvlink_lat_us = 10.0;
    m->ib_lat_us = 20.0;
}

/* GB/s of one direction of a GPU's link. */
static double nvlink_dir(const sp_machine *m)
{
    return m->nvlink_gbs / 2.0;
}

static double ib_dir(const sp_machine *m)
{
    return m->ib_gbps / 8.0;
}

sp_estimate sp_estimate_split(const sp_shape *s, const sp_machine *m, int u, int r)
{
    sp_estimate e;
    memset(&e, 0, sizeof e);
    e.u = u;
    e.r = r;
    e.valid = s->heads % u == 0 && (s->kv_heads % u == 0 || u % s->kv_heads == 0);
    const double n = (double)u * r, B = (double)s->batch, D = (double)s->head_dim;
    const double H = (double)s->heads, eb = (double)s->elem_bytes;
    const double tok = (double)(s->seqlen + s->text);
    const double pairs = s->causal ? tok * (tok + 1) / 2 : tok * tok;
    const double flops = 4.0 * B * H * D * pairs; /* 2 (d + dv) per visible pair and head */
    e.t1 = flops / (m->tflops * 1e12) * 1e3;
    e.compute = e.t1 / n; /* heads split evenly; zigzag evens out a causal ring */
    if (!e.valid)
        return e;
    const double kvl = s->kv_heads % u == 0 ? (double)s->kv_heads / u : 1.0; /* per rank */
    const double local = (double)s->seqlen / n, slot = (double)s->seqlen / r;
    const int G = m->gpus_per_node;

    /* Ulysses: (u - 1) / u of q, k, v out and of o back, per rank each way. */
    if (u > 1) {
        const double bytes =
            (u - 1.0) / u * B * local * (2.0 * H + 2.0 * kvl * u) * D * eb; /* q + o, k + v */
        e.ulysses_ib = u > G;
        /* Off-node peers (members beyond a node) go over InfiniBand. */
        const double off = u > G ? (double)(u - G) / (u - 1.0) : 0.0;
        const double t_nv = bytes * (1.0 - off) / (nvlink_dir(m) * 1e9 * m->a2a_eff);
        const double t_ib = bytes * off / (ib_dir(m) * 1e9 * m->a2a_eff);
        e.ulysses = (t_nv > t_ib ? t_nv : t_ib) * 1e3 +
                    2.0 * (e.ulysses_ib ? m->ib_lat_us : m->nvlink_lat_us) * 1e-3;
    }
    /* Ring: r steps of attention to one slot's keys, each followed by a
     * merge (read the running f32 result and the piece's, write the result);
     * the next slot's K/V travel meanwhile (r - 1 transfers). */
    const double merge_bytes = 3.0 * B * slot * (H / u) * D * 4.0;
    const double merge = merge_bytes / (m->hbm_tbs * 1e12 * m->merge_eff) * 1e3;
    e.merge = merge * r;
    e.ring_step_c = e.compute / r + merge;
    double ring = e.ring_step_c;
    if (r > 1) {
        const double bytes = B * slot * 2.0 * kvl * D * eb;
        e.ring_ib = (int64_t)u * r > G; /* some neighbours sit on other nodes */
        const double bw = (e.ring_ib ? ib_dir(m) : nvlink_dir(m)) * 1e9 * m->p2p_eff;
        e.ring_step_x = bytes / bw * 1e3 + (e.ring_ib ? m->ib_lat_us : m->nvlink_lat_us) * 1e-3;
        const double step = e.ring_step_c > e.ring_step_x ? e.ring_step_c : e.ring_step_x;
        ring = (r - 1) * step + e.ring_step_c;
    }
    e.total = e.ulysses + ring;
    e.efficiency = e.t1 / (n * e.total);
    return e;
}

static const char plan_usage[] =
    "usage: fmha sp-plan [--model PRESET | --heads H --kv-heads HK --head-dim D --seqlen S]\n"
    "       [--text T] [--batch B] [--causal] [--dtype bf16|f16|f32] [--devices N[,N...]]\n"
    "       [--gpus-per-node G] [--nvlink-gbs X] [--ib-gbps X] [--tflops X] [--hbm-tbs X]\n"
    "       [--merge-eff X] [--a2a-eff X] [--p2p-eff X] [--nvlink-lat-us X] [--ib-lat-us X]\n"
    "  Predicts sequence-parallel attention's time for every split ulysses x ring of N\n"
    "  devices (default 8) and names the best; with several N, a strong-scaling table of\n"
    "  the best split, the best Ulysses-only and the best ring-only. Defaults: H200 nodes\n"
    "  of 8 GPUs, NVLink 900 GB/s per GPU (both ways), InfiniBand 400 Gb/s per GPU, the\n"
    "  kernel at 634.8 TFLOP/s (bench/RESULTS.md, bf16 on an H200), the merges at 0.8 of\n"
    "  4.8 TB/s of HBM, all-to-all at 0.8 and send/recv at 0.9 of the links.\n"
    "  docs/sequence_parallel.md has the formulas.\n";

static int parse_double(const char *flag, const char *s, double lo, double *out)
{
    char *end;
    double x = strtod(s, &end);
    if (*s == '\0' || *end != '\0' || !isfinite(x) || x < lo) {
        fprintf(stderr, "fmha sp-plan: %s %s: expected a number >= %g\n", flag, s, lo);
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_int(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    long long x = strtoll(s, &end, 10);
    if (*s == '\0' || *end != '\0' || x < lo || x > hi) {
        fprintf(stderr, "fmha sp-plan: %s %s: expected an integer in [%lld, %lld]\n", flag, s,
                (long long)lo, (long long)hi);
        return -1;
    }
    *out = x;
    return 0;
}

static void print_split_table(const sp_shape *s, const sp_machine *m, int n)
{
    printf("%d devices (%d per node): attention alone %.2f ms on one device\n", n, m->gpus_per_node,
           sp_estimate_split(s, m, 1, 1).t1);
    printf("%8s %5s %10s %10s %10s %10s %9s %10s %6s\n", "ulysses", "ring", "compute", "ulysses",
           "step xfer", "step comp", "merges", "total ms", "eff.");
    sp_estimate best = {0};
    for (int u = 1; u <= n; u++) {
        if (n % u)
            continue;
        const sp_estimate e = sp_estimate_split(s, m, u, n / u);
        if (!e.valid) {
            printf("%8d %5d   heads %lld / kv heads %lld do not split over ulysses %d\n", u, n / u,
                   (long long)s->heads, (long long)s->kv_heads, u);
            continue;
        }
        printf("%8d %5d %10.3f %9.3f%s %9.3f%s %10.3f %9.3f %10.3f %5.1f%%\n", u, n / u, e.compute,
               e.ulysses, e.ulysses_ib ? "*" : " ", e.ring_step_x, e.ring_ib ? "*" : " ",
               e.ring_step_c, e.merge, e.total, 100 * e.efficiency);
        if (!best.valid || e.total < best.total)
            best = e;
    }
    if (best.valid)
        printf("best: ulysses %d x ring %d, %.3f ms, %.1f%% efficiency   (* crosses nodes: "
               "InfiniBand)\n",
               best.u, best.r, best.total, 100 * best.efficiency);
}

static void print_scaling(const sp_shape *s, const sp_machine *m, const int *ns, int count)
{
    printf("%8s %22s %22s %22s\n", "devices", "best (u x r) eff.", "ulysses only eff.",
           "ring only eff.");
    for (int i = 0; i < count; i++) {
        const int n = ns[i];
        sp_estimate best = {0};
        for (int u = 1; u <= n; u++) {
            if (n % u)
                continue;
            const sp_estimate e = sp_estimate_split(s, m, u, n / u);
            if (e.valid && (!best.valid || e.total < best.total))
                best = e;
        }
        const sp_estimate ul = sp_estimate_split(s, m, n, 1), ring = sp_estimate_split(s, m, 1, n);
        char b1[32], b2[32], b3[32];
        snprintf(b1, sizeof b1, "%d x %d  %5.1f%%", best.u, best.r, 100 * best.efficiency);
        if (ul.valid)
            snprintf(b2, sizeof b2, "%5.1f%%", 100 * ul.efficiency);
        else
            snprintf(b2, sizeof b2, "heads do not split");
        snprintf(b3, sizeof b3, "%5.1f%%", 100 * ring.efficiency);
        printf("%8d %22s %22s %22s\n", n, best.valid ? b1 : "-", b2, b3);
    }
}

int sp_plan_main(int argc, char **argv)
{
    sp_machine m;
    sp_machine_defaults(&m);
    sp_shape s = {1, 0, 0, 0, 0, 128, 2, 0};
    int devices[32], ndev = 0;
    enum {
        O_MODEL = 256,
        O_HEADS,
        O_KV,
        O_HD,
        O_SEQ,
        O_TEXT,
        O_BATCH,
        O_CAUSAL,
        O_DTYPE,
        O_DEV,
        O_GPN,
        O_NVL,
        O_IB,
        O_TF,
        O_HBM,
        O_MERGE,
        O_A2A,
        O_P2P,
        O_NVLAT,
        O_IBLAT
    };
    static const struct option longopts[] = {
        {"model", required_argument, 0, O_MODEL},
        {"heads", required_argument, 0, O_HEADS},
        {"kv-heads", required_argument, 0, O_KV},
        {"head-dim", required_argument, 0, O_HD},
        {"seqlen", required_argument, 0, O_SEQ},
        {"text", required_argument, 0, O_TEXT},
        {"batch", required_argument, 0, O_BATCH},
        {"causal", no_argument, 0, O_CAUSAL},
        {"dtype", required_argument, 0, O_DTYPE},
        {"devices", required_argument, 0, O_DEV},
        {"gpus-per-node", required_argument, 0, O_GPN},
        {"nvlink-gbs", required_argument, 0, O_NVL},
        {"ib-gbps", required_argument, 0, O_IB},
        {"tflops", required_argument, 0, O_TF},
        {"hbm-tbs", required_argument, 0, O_HBM},
        {"merge-eff", required_argument, 0, O_MERGE},
        {"a2a-eff", required_argument, 0, O_A2A},
        {"p2p-eff", required_argument, 0, O_P2P},
        {"nvlink-lat-us", required_argument, 0, O_NVLAT},
        {"ib-lat-us", required_argument, 0, O_IBLAT},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    int c;
    int64_t x;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case O_MODEL: {
            const fmha_preset *p = fmha_preset_find(optarg);
            if (!p) {
                fprintf(stderr, "fmha sp-plan: unknown preset '%s' (fmha help lists them)\n",
                        optarg);
                return 2;
            }
            s.heads = p->heads, s.kv_heads = p->kv_heads, s.head_dim = p->head_dim;
            s.seqlen = p->seqlen_q, s.causal = p->causal;
            break;
        }
        case O_HEADS: bad = parse_int("--heads", optarg, 1, 65536, &s.heads); break;
        case O_KV: bad = parse_int("--kv-heads", optarg, 1, 65536, &s.kv_heads); break;
        case O_HD: bad = parse_int("--head-dim", optarg, 1, 65536, &s.head_dim); break;
        case O_SEQ: bad = parse_int("--seqlen", optarg, 1, (int64_t)1 << 40, &s.seqlen); break;
        case O_TEXT: bad = parse_int("--text", optarg, 0, (int64_t)1 << 40, &s.text); break;
        case O_BATCH: bad = parse_int("--batch", optarg, 1, 1 << 30, &s.batch); break;
        case O_CAUSAL: s.causal = 1; break;
        case O_DTYPE:
            if (!strcmp(optarg, "bf16") || !strcmp(optarg, "f16"))
                s.elem_bytes = 2;
            else if (!strcmp(optarg, "f32"))
                s.elem_bytes = 4;
            else {
                fprintf(stderr, "fmha sp-plan: --dtype %s: expected bf16, f16 or f32\n", optarg);
                bad = 1;
            }
            break;
        case O_DEV: {
            ndev = 0;
            for (char *tok = strtok(optarg, ","); tok && !bad; tok = strtok(NULL, ",")) {
                if (ndev == 32) {
                    fprintf(stderr, "fmha sp-plan: --devices: at most 32 counts\n");
                    bad = 1;
                } else if (!(bad = parse_int("--devices", tok, 1, 65536, &x)))
                    devices[ndev++] = (int)x;
            }
            break;
        }
        case O_GPN:
            if (!(bad = parse_int("--gpus-per-node", optarg, 1, 4096, &x)))
                m.gpus_per_node = (int)x;
            break;
        case O_NVL: bad = parse_double("--nvlink-gbs", optarg, 1e-3, &m.nvlink_gbs); break;
        case O_IB: bad = parse_double("--ib-gbps", optarg, 1e-3, &m.ib_gbps); break;
        case O_TF: bad = parse_double("--tflops", optarg, 1e-6, &m.tflops); break;
        case O_HBM: bad = parse_double("--hbm-tbs", optarg, 1e-6, &m.hbm_tbs); break;
        case O_MERGE: bad = parse_double("--merge-eff", optarg, 1e-3, &m.merge_eff); break;
        case O_A2A: bad = parse_double("--a2a-eff", optarg, 1e-3, &m.a2a_eff); break;
        case O_P2P: bad = parse_double("--p2p-eff", optarg, 1e-3, &m.p2p_eff); break;
        case O_NVLAT: bad = parse_double("--nvlink-lat-us", optarg, 0, &m.nvlink_lat_us); break;
        case O_IBLAT: bad = parse_double("--ib-lat-us", optarg, 0, &m.ib_lat_us); break;
        case 'h': fputs(plan_usage, stdout); return 0;
        default: fputs(plan_usage, stderr); return 2;
        }
        if (bad)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "fmha sp-plan: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (!s.heads || !s.seqlen) {
        fprintf(stderr, "fmha sp-plan: give --model PRESET or --heads and --seqlen\n%s",
                plan_usage);
        return 2;
    }
    if (!s.kv_heads)
        s.kv_heads = s.heads;
    if (s.heads % s.kv_heads) {
        fprintf(stderr, "fmha sp-plan: heads (%lld) must be a multiple of kv heads (%lld)\n",
                (long long)s.heads, (long long)s.kv_heads);
        return 2;
    }
    if (m.a2a_eff > 1 || m.p2p_eff > 1 || m.merge_eff > 1) {
        fprintf(stderr, "fmha sp-plan: --a2a-eff, --p2p-eff and --merge-eff are fractions of a "
                        "bandwidth, <= 1\n");
        return 2;
    }
    char text[48] = "";
    if (s.text)
        snprintf(text, sizeof text, " + %lld text", (long long)s.text);
    printf("shape: batch %lld, %lld tokens%s, heads %lld / kv %lld, head dim %lld, %s%s\n",
           (long long)s.batch, (long long)s.seqlen, text, (long long)s.heads, (long long)s.kv_heads,
           (long long)s.head_dim, s.elem_bytes == 4 ? "f32" : "16-bit", s.causal ? ", causal" : "");
    printf("machine: %d GPUs per node, NVLink %.0f GB/s, InfiniBand %.0f Gb/s per GPU, kernel "
           "%.1f TFLOP/s, HBM %.1f TB/s (merges at %.2f of it), all-to-all %.2f, send/recv %.2f "
           "of the link\n",
           m.gpus_per_node, m.nvlink_gbs, m.ib_gbps, m.tflops, m.hbm_tbs, m.merge_eff, m.a2a_eff,
           m.p2p_eff);
    if (ndev == 0)
        devices[ndev++] = 8;
    if (ndev == 1) {
        print_split_table(&s, &m, devices[0]);
    } else {
        print_scaling(&s, &m, devices, ndev);
    }
    return 0;
}
