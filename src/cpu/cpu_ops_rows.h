/* cpu_ops_rows.h — decode's products (cpu.h's row_qk and row_pv): a slot of
 * a few query rows against key and value rows read straight from the cache,
 * SIMD lanes running over channels. The tiles' products put lanes over
 * queries, which a decode step's 1 to 8 queries of a KV head fill a quarter
 * of at best, and copy every row into a block first; here each row is read
 * once, converted in registers, and multiplied by every query of the slot.
 * row_qk_walk, the order of the key walk and its prefetches, serves the
 * bf16 pair kernels too (cpu_ops_avx512.c). Written once over
 * cpu_ops_f32.h's vocabulary plus
 *   VLOADX(row, dtype, c) -> channels [c, c + VL) of an f32, f16, bf16 or
 *                            f8_e4m3 row (the codes' values: FP8 caches'
 *                            descales multiply the scores and P here)
 *   VHSUM(x) -> the sum of x's lanes
 *   VHSUM4(a, b, c, d, out) -> out[0..3] = VHSUM of each
 * and cpu_ops_io.h's FMHA_PREFETCH and FMHA_PREFETCH_L2; included after both
 * by the ISA files that define those. */

#define INLINE static inline __attribute__((always_inline))

enum { ROW_MR = 4 }; /* queries per register tile; VHSUM4 sums four rows */
/* Key rows this many tokens ahead are prefetched into L1 (the hardware
 * prefetcher follows the address order, but not that far ahead in time). */
enum { ROW_KEYS_AHEAD = 16 };

/* out[r] = q row r . key row kr for r < mr (q rows dp apart, zero past d). */
INLINE void row_qk_tile(const float *qr, int64_t dp, const char *kr, fmha_dtype dt, int64_t d,
                        float *out, const int mr)
{
    V acc[ROW_MR];
    for (int r = 0; r < mr; r++)
        acc[r] = VZERO();
    int64_t c = 0;
    for (; c + VL <= d; c += VL) {
        const V kv = VLOADX(kr, dt, c);
        for (int r = 0; r < mr; r++)
            acc[r] = VFMA(VLOAD(qr + r * dp + c), kv, acc[r]);
    }
    if (mr == ROW_MR && c == d) {
        VHSUM4(acc[0], acc[1], acc[2], acc[3], out);
        return;
    }
    for (int r = 0; r < mr; r++) {
        float x = VHSUM(acc[r]);
        for (int64_t cc = c; cc < d; cc++)
            x += qr[r * dp + cc] * fmha_load_f32(kr, dt, cc);
        out[r] = x;
    }
}

/* A slot's rows of queries q (rows dp elements apart) against key row kr
 * into out[0 .. rows). */
typedef void (*row_qk_slot_fn)(const void *q, int64_t dp, const char *kr, int64_t d, int rows,
                               float *out);

/* Keys [j0, j0 + nj) against every slot's queries, key by key: slot k's
 * `rows` queries (qr + k * width * dp elements of `elem` bytes) against
 * the keys of KV head hk[k] into st[j][k * width + i], 0 on to the slot's
 * width. A token's rows of the slots' heads are read one after another,
 * which is address order where the heads sit side by side (BSHD caches,
 * pages), and the token's value rows are prefetched into L2 for row_pv,
 * which walks them head by head. The row products are `slot`'s (inlined
 * where it is a constant). */
INLINE void row_qk_walk(const fmha_cpu_task *t, const void *qr, int64_t elem, int rows, int slots,
                        int width, const int64_t *hk, int64_t j0, int nj, float *st,
                        row_qk_slot_fn slot)
{
    const fmha_problem *pb = t->pb;
    const fmha_tensor *k = &pb->args->k, *v = &pb->args->v;
    const int64_t kbytes = pb->d * (int64_t)fmha_dtype_size(k->dtype);
    const int64_t vbytes = pb->dv * (int64_t)fmha_dtype_size(v->dtype);
    /* one slot: zeros on to a whole vector of queries for softmax */
    const int wz = slots > 1 ? width : (rows + FMHA_CPU_NQ - 1) / FMHA_CPU_NQ * FMHA_CPU_NQ;
    /* KV head 0's rows of the block's keys (and of the keys ahead); a
     * head's are stride_head further on */
    const char *krow[FMHA_CPU_BC + ROW_KEYS_AHEAD], *vrow[FMHA_CPU_BC];
    const int nk = (int)(t->sk - j0 < nj + ROW_KEYS_AHEAD ? t->sk - j0 : nj + ROW_KEYS_AHEAD);
    fmha_kv_rows(pb, k, t->b, j0, nk, 0, krow);
    fmha_kv_rows(pb, v, t->b, j0, nj, 0, vrow);
    const int64_t ksh = (int64_t)(fmha_row(k, 0, 0, 1) - fmha_row(k, 0, 0, 0));
    const int64_t vsh = (int64_t)(fmha_row(v, 0, 0, 1) - fmha_row(v, 0, 0, 0));
    for (int j = 0; j < nj; j++) {
        for (int s = 0; s < slots; s++) {
            const char *kr = krow[j] + hk[s] * ksh;
            const char *vr = vrow[j] + hk[s] * vsh;
            for (int64_t byte = 0; byte < vbytes; byte += 64)
                FMHA_PREFETCH_L2(vr + byte);
            if (j + ROW_KEYS_AHEAD < nk) {
                const char *ahead = krow[j + ROW_KEYS_AHEAD] + hk[s] * ksh;
                for (int64_t byte = 0; byte < kbytes; byte += 64)
                    FMHA_PREFETCH(ahead + byte);
            }
            float *out = st + j * T_BR + s * width;
            slot((const char *)qr + s * width * t->dp * elem, t->dp, kr, pb->d, rows, out);
            if (k->dtype == FMHA_DTYPE_F8_E4M3) {
                const float kd = fmha_row_descale(pb, 1, t->b, j0 + j, hk[s]);
                for (int i = 0; i < rows; i++)
                    out[i] *= kd;
            }
            for (int i = rows; i < wz; i++)
                out[i] = 0.0f;
        }
    }
}

/* A slot's rows in register tiles of ROW_MR, then one by one. */
INLINE void row_qk_slot(const void *qv, int64_t dp, const char *kr, int64_t d, int rows, float *out,
                        const fmha_dtype dt)
{
    const float *q = qv;
    int i = 0;
    for (; i + ROW_MR <= rows; i += ROW_MR)
        row_qk_tile(q + i * dp, dp, kr, dt, d, out + i, ROW_MR);
    for (; i < rows; i++)
        row_qk_tile(q + i * dp, dp, kr, dt, d, out + i, 1);
}

static void row_qk_slot_bf16(const void *q, int64_t dp, const char *kr, int64_t d, int rows,
                             float *out)
{
    row_qk_slot(q, dp, kr, d, rows, out, FMHA_DTYPE_BF16);
}

static void row_qk_slot_f16(const void *q, int64_t dp, const char *kr, int64_t d, int rows,
                            float *out)
{
    row_qk_slot(q, dp, kr, d, rows, out, FMHA_DTYPE_F16);
}

static void row_qk_slot_f32(const void *q, int64_t dp, const char *kr, int64_t d, int rows,
                            float *out)
{
    row_qk_slot(q, dp, kr, d, rows, out, FMHA_DTYPE_F32);
}

static void row_qk_slot_f8(const void *q, int64_t dp, const char *kr, int64_t d, int rows,
                           float *out)
{
    row_qk_slot(q, dp, kr, d, rows, out, FMHA_DTYPE_F8_E4M3);
}

/* cpu.h's row_qk: the queries are f32 rows, keys converted as they load. */
static void row_qk(const fmha_cpu_task *t, const void *qr, int rows, int slots, int width,
                   const int64_t *hk, int64_t j0, int nj, float *st)
{
    switch (t->pb->args->k.dtype) {
    case FMHA_DTYPE_BF16:
        row_qk_walk(t, qr, 4, rows, slots, width, hk, j0, nj, st, row_qk_slot_bf16);
        break;
    case FMHA_DTYPE_F16:
        row_qk_walk(t, qr, 4, rows, slots, width, hk, j0, nj, st, row_qk_slot_f16);
        break;
    case FMHA_DTYPE_F8_E4M3:
        row_qk_walk(t, qr, 4, rows, slots, width, hk, j0, nj, st, row_qk_slot_f8);
        break;
    default: row_qk_walk(t, qr, 4, rows, slots, width, hk, j0, nj, st, row_qk_slot_f32); break;
    }
}

/* Channels [c, c + nv VL) of o's rows [i0, i0 + mr): alpha times the old
 * values plus the block's probabilities times the value rows vr. */
INLINE void row_pv_tile(const float *p, int nj, const char *const *vr, fmha_dtype dt,
                        const float *alpha, float *o, int64_t dvp, int i0, int64_t c, const int mr,
                        const int nv)
{
    V acc[ROW_MR][2];
    for (int r = 0; r < mr; r++) {
        const V a = VSET1(alpha[i0 + r]);
        for (int x = 0; x < nv; x++)
            acc[r][x] = VMUL(a, VLOAD(o + (i0 + r) * dvp + c + x * VL));
    }
    for (int j = 0; j < nj; j++) {
        V vv[2];
        for (int x = 0; x < nv; x++)
            vv[x] = VLOADX(vr[j], dt, c + x * VL);
        for (int r = 0; r < mr; r++) {
            const V pj = VSET1(p[j * T_BR + i0 + r]);
            for (int x = 0; x < nv; x++)
                acc[r][x] = VFMA(pj, vv[x], acc[r][x]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int x = 0; x < nv; x++)
            VSTORE(o + (i0 + r) * dvp + c + x * VL, acc[r][x]);
}

/* Rows [i0, i0 + mr) over every channel: two vectors at a time, then one,
 * then the channels past the last whole vector one by one. */
INLINE void row_pv_rows(const float *p, int nj, const char *const *vr, fmha_dtype dt,
                        const float *alpha, float *o, int64_t dv, int64_t dvp, int i0, const int mr)
{
    int64_t c = 0;
    for (; c + 2 * VL <= dv; c += 2 * VL)
        row_pv_tile(p, nj, vr, dt, alpha, o, dvp, i0, c, mr, 2);
    for (; c + VL <= dv; c += VL)
        row_pv_tile(p, nj, vr, dt, alpha, o, dvp, i0, c, mr, 1);
    for (int r = 0; r < mr; r++)
        for (int64_t cc = c; cc < dv; cc++) {
            float acc = alpha[i0 + r] * o[(i0 + r) * dvp + cc];
            for (int j = 0; j < nj; j++)
                acc += p[j * T_BR + i0 + r] * fmha_load_f32(vr[j], dt, cc);
            o[(i0 + r) * dvp + cc] = acc;
        }
}

/* row_pv for one value dtype (a constant where it is inlined). */
INLINE void row_pv_dt(const float *p, int nj, const char *const *vr, const float *alpha, float *o,
                      int64_t dv, int64_t dvp, int rows, const fmha_dtype dt)
{
    int i = 0;
    for (; i + ROW_MR <= rows; i += ROW_MR)
        row_pv_rows(p, nj, vr, dt, alpha, o, dv, dvp, i, ROW_MR);
    for (; i < rows; i++)
        row_pv_rows(p, nj, vr, dt, alpha, o, dv, dvp, i, 1);
}

/* p: the slot's probabilities, in the task's scratch: FP8 values' descales
 * multiply them in place (softmax has summed them already). */
static void row_pv(const fmha_cpu_task *t, const float *p, int rows, int64_t j0, int nj,
                   const float *alpha, float *o)
{
    const fmha_problem *pb = t->pb;
    const fmha_tensor *v = &pb->args->v;
    const char *vr[FMHA_CPU_BC];
    fmha_kv_rows(pb, v, t->b, j0, nj, t->hk, vr);
    switch (v->dtype) {
    case FMHA_DTYPE_F8_E4M3:
        for (int j = 0; j < nj; j++) {
            const float vd = fmha_row_descale(pb, 2, t->b, j0 + j, t->hk);
            for (int i = 0; i < rows; i++)
                ((float *)p)[j * T_BR + i] *= vd;
        }
        row_pv_dt(p, nj, vr, alpha, o, pb->dv, t->dvp, rows, FMHA_DTYPE_F8_E4M3);
        break;
    case FMHA_DTYPE_BF16:
        row_pv_dt(p, nj, vr, alpha, o, pb->dv, t->dvp, rows, FMHA_DTYPE_BF16);
        break;
    case FMHA_DTYPE_F16:
        row_pv_dt(p, nj, vr, alpha, o, pb->dv, t->dvp, rows, FMHA_DTYPE_F16);
        break;
    default: row_pv_dt(p, nj, vr, alpha, o, pb->dv, t->dvp, rows, FMHA_DTYPE_F32); break;
    }
}

#undef INLINE
