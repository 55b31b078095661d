/* cpu_ops_io.h — the micro-kernels that move rows between the tensors and
 * the f32 tiles (pack_q, load_k, load_v, pack_p) and the store every table
 * shares, written once over the including file's
 *   static void to_f32(float *dst, const void *src, fmha_dtype dtype, int64_t n, float descale)
 * (dst[0..n) = src[0..n) as f32; f8_e4m3 codes times descale). Included by
 * each ISA file, so that to_f32 inlines. Contracts are in cpu.h. */

/* Rows go 16 at a time so that each store fills whole cache lines of Q^T. */
static void pack_q(const fmha_cpu_task *t, void *qtv, void *tmpv)
{
    enum { G = 16 };
    const fmha_problem *pb = t->pb;
    const fmha_tensor *q = &pb->args->q;
    const int64_t d = pb->d;
    float *qt = qtv, *tmp = tmpv; /* tmp: [G][dp] */
    for (int i0 = 0; i0 < t->rows; i0 += G) {
        const int n = t->rows - i0 < G ? t->rows - i0 : G;
        for (int i = 0; i < n; i++) {
            const int64_t tok = t->q0 + t->row_pos[i0 + i], h = t->row_head[i0 + i];
            to_f32(tmp + i * t->dp, fmha_row(q, t->tb, tok, h), q->dtype, d,
                   fmha_row_descale(pb, 0, t->b, tok, h));
        }
        for (int64_t c = 0; c < d; c++)
            for (int i = 0; i < n; i++)
                qt[c * FMHA_CPU_BR + i0 + i] = tmp[i * t->dp + c];
    }
    const int pad = fmha_cpu_vector_rows(t->rows) - t->rows;
    for (int64_t c = 0; pad && c < d; c++)
        memset(qt + c * FMHA_CPU_BR + t->rows, 0, (size_t)pad * 4);
}

/* Row j + PF_AHEAD of the task's keys on its way to the cache while row j
 * converts: rows of one KV head sit a token apart, too far apart for the
 * hardware prefetcher, so each row's latency was paid in turn. */
enum { PF_AHEAD = 16 };
#if defined(__x86_64__) || defined(__i386__)
/* An asm statement: GCC 12 at -O1 and above drops __builtin_prefetch here. */
#define FMHA_PREFETCH(p)    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(p)))
#define FMHA_PREFETCH_L2(p) __asm__ volatile("prefetcht2 %0" : : "m"(*(const char *)(p)))
#else
#define FMHA_PREFETCH(p)    __builtin_prefetch((p), 0, 3)
#define FMHA_PREFETCH_L2(p) __builtin_prefetch((p), 0, 1)
#endif
static inline void prefetch_row(const fmha_cpu_task *t, const fmha_tensor *x, int64_t j,
                                int64_t bytes)
{
    if (j + PF_AHEAD >= t->sk)
        return;
    const char *row = fmha_kv_row(t->pb, x, t->b, j + PF_AHEAD, t->hk);
    for (int64_t byte = 0; byte < bytes; byte += 64)
        FMHA_PREFETCH(row + byte);
}

/* Key rows are copied into a dense block: rows a token apart alias in L1
 * and the copy costs less than the misses. */
static void load_k(const fmha_cpu_task *t, int64_t j0, int nj, void *kbv)
{
    const fmha_problem *pb = t->pb;
    const fmha_tensor *k = &pb->args->k;
    float *kb = kbv;
    const int64_t bytes = pb->d * (int64_t)fmha_dtype_size(k->dtype);
    for (int j = 0; j < nj; j++) {
        const int64_t tok = t->k0 + j0 + j;
        prefetch_row(t, k, j0 + j, bytes);
        to_f32(kb + j * t->dp, fmha_kv_row(pb, k, t->b, j0 + j, t->hk), k->dtype, pb->d,
               fmha_row_descale(pb, 1, t->b, tok, t->hk));
    }
}

static void load_v(const fmha_cpu_task *t, int64_t j0, int nj, void *vbv)
{
    const fmha_problem *pb = t->pb;
    const fmha_tensor *v = &pb->args->v;
    float *vb = vbv;
    const int64_t bytes = pb->dv * (int64_t)fmha_dtype_size(v->dtype);
    for (int j = 0; j < nj; j++) {
        const int64_t tok = t->k0 + j0 + j;
        prefetch_row(t, v, j0 + j, bytes);
        to_f32(vb + j * t->dvp, fmha_kv_row(pb, v, t->b, j0 + j, t->hk), v->dtype, pb->dv,
               fmha_row_descale(pb, 2, t->b, tok, t->hk));
        for (int64_t c = pb->dv; c < t->dvp; c++)
            vb[j * t->dvp + c] = 0.0f;
    }
}

/* The f32 pv multiplies by the probabilities as softmax left them. */
static void pack_p(float *st, int nj, int nq)
{
    (void)st, (void)nj, (void)nq;
}

static void store(const fmha_cpu_task *t, const float *o, const float *m, const float *l)
{
    const fmha_problem *pb = t->pb;
    const fmha_forward_args *a = pb->args;
    const fmha_tensor *out = &a->out;
    for (int i = 0; i < t->rows; i++) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        const int64_t pos = t->row_pos[i], h = t->row_head[i];
        char *orow = fmha_row(out, t->tb, t->q0 + pos, h);
        const float *acc = o + (int64_t)i * t->dvp;
        if (out->dtype == FMHA_DTYPE_F32) {
            for (int64_t c = 0; c < pb->dv; c++)
                ((float *)orow)[c] = acc[c] * inv;
        } else {
            for (int64_t c = 0; c < pb->dv; c++)
                fmha_store_f32(orow, out->dtype, c, acc[c] * inv);
        }
        if (a->lse) {
            const int64_t idx =
                pb->varlen ? h * a->q.seqlen + t->q0 + pos : (t->b * pb->heads + h) * t->sq + pos;
            /* A NaN row (docs/reliability.md) has a NaN LSE; a row of no key -inf. */
            a->lse[idx] = l[i] > 0.0f ? (float)((m[i] + log2((double)l[i])) * 0.6931471805599453)
                          : isnan(l[i]) || isnan(m[i]) ? NAN
                                                       : -INFINITY;
        }
    }
}

/* ---------------------------------------------------------------- backward */

static void load_rows(const fmha_tensor *t, int64_t tb, int64_t tok, int64_t h, int n, int64_t cols,
                      int64_t stride, float *dst)
{
    for (int r = 0; r < n; r++) {
        float *row = dst + r * stride;
        to_f32(row, fmha_row(t, tb, tok + r, h), t->dtype, cols, 1.0f);
        for (int64_t c = cols; c < stride; c++)
            row[c] = 0.0f;
    }
}

/* Rows go 16 at a time, as in pack_q. */
static void pack_rows_t(const fmha_tensor *t, int64_t tb, int64_t tok, int64_t h, int n,
                        int64_t cols, float *dst, float *tmp)
{
    enum { G = 16 };
    memset(dst, 0, (size_t)cols * FMHA_CPU_BR * 4);
    for (int r0 = 0; r0 < n; r0 += G) {
        const int m = n - r0 < G ? n - r0 : G;
        for (int r = 0; r < m; r++)
            to_f32(tmp + r * cols, fmha_row(t, tb, tok + r0 + r, h), t->dtype, cols, 1.0f);
        for (int64_t c = 0; c < cols; c++)
            for (int r = 0; r < m; r++)
                dst[c * FMHA_CPU_BR + r0 + r] = tmp[r * cols + c];
    }
}
