/* cpu_ops_rows.h — decode's products (cpu.h's row_qk and row_pv): a slot of
 * a few query rows against key and value rows read straight from the cache,
 * SIMD lanes running over channels. The tiles' products put lanes over
 * queries, which a decode step's 1 to 8 queries of a KV head fill a quarter
 * of at best, and copy every row into a block first; here each row is read
 * once, converted in registers, and multiplied by every query of the slot.
 * Written once over cpu_ops_f32.h's vocabulary plus
 *   VLOADX(row, dtype, c) -> channels [c, c + VL) of an f32, f16 or bf16 row
 *   VHSUM(x) -> the sum of x's lanes
 * and cpu_ops_io.h's prefetch_row; included after both by the ISA files
 * that define those two. */

#define INLINE static inline __attribute__((always_inline))

enum { ROW_MR = 4 }; /* queries per register tile */

/* out[r] = q row r . key row kr for r < mr; q rows are dp apart. */
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
    for (int r = 0; r < mr; r++) {
        float x = VHSUM(acc[r]);
        for (int64_t cc = c; cc < d; cc++)
            x += qr[r * dp + cc] * fmha_load_f32(kr, dt, cc);
        out[r] = x;
    }
}

static void row_qk(const fmha_cpu_task *t, const float *qr, int rows, int64_t j0, int nj, float *st)
{
    const fmha_problem *pb = t->pb;
    const fmha_tensor *k = &pb->args->k;
    const int64_t bytes = pb->d * (int64_t)fmha_dtype_size(k->dtype);
    const int width = (rows + FMHA_CPU_NQ - 1) / FMHA_CPU_NQ * FMHA_CPU_NQ;
    for (int j = 0; j < nj; j++) {
        prefetch_row(t, k, j0 + j, bytes);
        const char *kr = fmha_kv_row(pb, k, t->b, j0 + j, t->hk);
        float *out = st + j * T_BR;
        int i = 0;
        for (; i + ROW_MR <= rows; i += ROW_MR)
            row_qk_tile(qr + i * t->dp, t->dp, kr, k->dtype, pb->d, out + i, ROW_MR);
        for (; i < rows; i++)
            row_qk_tile(qr + i * t->dp, t->dp, kr, k->dtype, pb->d, out + i, 1);
        for (; i < width; i++)
            out[i] = 0.0f;
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

static void row_pv(const fmha_cpu_task *t, const float *p, int rows, int64_t j0, int nj,
                   const float *alpha, float *o)
{
    const fmha_problem *pb = t->pb;
    const fmha_tensor *v = &pb->args->v;
    const int64_t bytes = pb->dv * (int64_t)fmha_dtype_size(v->dtype);
    const char *vr[FMHA_CPU_BC];
    for (int j = 0; j < nj; j++) {
        prefetch_row(t, v, j0 + j, bytes);
        vr[j] = fmha_kv_row(pb, v, t->b, j0 + j, t->hk);
    }
    int i = 0;
    for (; i + ROW_MR <= rows; i += ROW_MR)
        row_pv_rows(p, nj, vr, v->dtype, alpha, o, pb->dv, t->dvp, i, ROW_MR);
    for (; i < rows; i++)
        row_pv_rows(p, nj, vr, v->dtype, alpha, o, pb->dv, t->dvp, i, 1);
}

#undef INLINE
