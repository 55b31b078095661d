/* launch.cu — the Hopper kernel's host side: tensor maps, the scratch pool, the choice of kernel
 * variant and the launches behind fmha_cuda::hopper_forward and hopper_fp8_forward. The one
 * translation unit of src/cuda/hopper/, which holds the kernel in parts:
 *   ptx.cuh       inline PTX wrappers
 *   tiles.cuh     tile sizes, shared memory, parameters (sched.cuh: the tile schedule)
 *   mainloop.cuh  the consumers' two GEMMs and online softmax (wgmma.inc: the wgmma wrappers)
 *   kernel.cuh    hopper_fwd
 *   combine.cuh   the split-KV combine kernel
 *   fp8_vt.cuh    FP8's V transpose */
#include "../../alloc.h"
#include "combine.cuh"
#include "fp8_vt.cuh"
#include "kernel.cuh"
#include "tiles.cuh"

#include <cuda.h>
#include <cudaTypedefs.h> /* PFN_cuTensorMapEncodeTiled */

#include <math.h>
#include <stdint.h>

#include <atomic>

namespace
{
using namespace fmha_cuda;

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled()
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            f = nullptr;
        return (PFN_cuTensorMapEncodeTiled_v12000)f;
    }();
    return fn;
}

/* A 4-D map (columns, rows, heads, batch) over a tensor of `eb`-byte
 * elements, in boxes of 128 bytes of columns x box_rows rows, 128-byte
 * swizzled. Coordinates past the tensor's extents read as zeros. */
fmha_status make_map_raw(CUtensorMap *map, void *data, CUtensorMapDataType type, int eb,
                         const int64_t dims_in[4], const int64_t strides_in[3], int box_rows,
                         const char *name)
{
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
    if (!encode)
        return fmha_set_error(
            FMHA_STATUS_BACKEND_ERROR,
            "the CUDA driver has no cuTensorMapEncodeTiled (driver older than 12.0?)");
    cuuint64_t dims[4], strides[3];
    for (int i = 0; i < 4; i++)
        dims[i] = (cuuint64_t)dims_in[i];
    /* Strides of extent-1 axes are never followed; any legal value does. */
    for (int i = 0; i < 3; i++)
        strides[i] = (cuuint64_t)(dims_in[i + 1] > 1 ? strides_in[i] * eb : 16);
    cuuint32_t box[4] = {(cuuint32_t)(128 / eb), (cuuint32_t)box_rows, 1, 1};
    cuuint32_t estr[4] = {1, 1, 1, 1};
    CUresult r = encode(map, type, 4, data, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return fmha_set_error(FMHA_STATUS_BACKEND_ERROR,
                              "cuTensorMapEncodeTiled refused %s (error %d): strides (%lld, %lld, "
                              "%lld) elements",
                              name, (int)r, (long long)strides_in[0], (long long)strides_in[1],
                              (long long)strides_in[2]);
    return FMHA_STATUS_OK;
}

/* The map of q, k or v: (head-dim column, token, head, batch). */
fmha_status make_map(CUtensorMap *map, const fmha_tensor &t, int box_rows, int in, const char *name)
{
    const int64_t dims[4] = {t.head_dim, t.seqlen, t.heads, t.batch};
    const int64_t strides[3] = {t.stride_seq, t.stride_head, t.stride_batch};
    const bool b8 = in == IN_E4M3 || in == IN_S8Q;
    const CUtensorMapDataType type = b8              ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                     : in == IN_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                     : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return make_map_raw(map, t.data, type, b8 ? 1 : 2, dims, strides, box_rows, name);
}

/* Every query tile of the launch sees the same keys: not causal, windowed
 * or packed. */
bool uniform_tiles(const flash_params &p)
{
    return !p.varlen && !p.causal && p.window_left < 0 && p.window_right < 0;
}

/* The launch's schedule (sched.cuh) for `resident` blocks at a time,
 * in FMHA_CUDA_SCHEDULE's mode (cuda.h). */
hopper_sched plan(const flash_params &p, int64_t max_sq, int batch, int BM, int BN, int resident,
                  fmha_schedule mode, int cl)
{
    const int64_t tiles_x = (max_sq + BM - 1) / BM;
    return sched_plan(tiles_x * p.heads * batch, tiles_x, (p.sk + BN - 1) / BN, resident,
                      uniform_tiles(p), mode, cl);
}

/* The kernel on its schedule; a split tail's partials live in pooled
 * scratch until combine_kernel has merged them. */
template <int D, int IN, bool DROPOUT, bool TWO_LEVEL, int CL>
cudaError_t launch_variant(hopper_params &hp, int64_t max_sq, int batch, fmha_schedule mode,
                           cudaStream_t stream)
{
    typedef htile<D, IN> TL;
    static_assert(TL::SMEM <= 227 * 1024, "tile exceeds the 227 KB of shared memory per block");
    auto kernel = hopper_fwd<D, IN, DROPOUT, TWO_LEVEL, CL>;
    const size_t smem = TL::SMEM;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = CL, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(TL::THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &cluster;
    cfg.numAttrs = CL > 1;
    /* Once per device: the shared-memory attribute, and how many blocks fit at once. */
    static std::atomic<int> resident_on[64];
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess)
        return err;
    int resident = dev >= 0 && dev < 64 ? resident_on[dev].load(std::memory_order_relaxed) : 0;
    if (resident == 0) {
        int sms = 0, per_sm = 0, clusters = 0;
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err == cudaSuccess)
            err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (err == cudaSuccess && CL == 1)
            err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, TL::THREADS, smem);
        if (err == cudaSuccess && CL > 1) {
            cfg.gridDim = dim3(sms - sms % CL);
            err = cudaOccupancyMaxActiveClusters(&clusters, (void *)kernel, &cfg);
        }
        if (err != cudaSuccess)
            return err;
        resident = CL == 1 ? sms * per_sm : clusters * CL;
        if (dev >= 0 && dev < 64 && resident > 0)
            resident_on[dev].store(resident, std::memory_order_relaxed);
    }
    hp.s = plan(hp.p, max_sq, batch, TL::BM, TL::BN, resident, mode, CL);
    if (hp.s.ctas <= 0) /* -1: more tiles than the schedule numbers */
        return hp.s.ctas == 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
    void *parts = nullptr;
    if (hp.s.sk_tiles > 0) {
        const int64_t slots = 2 * (int64_t)hp.s.ctas * CL * TL::BM;
        if ((err = scratch_alloc(&parts, (size_t)(slots * (D + 1)) * sizeof(float), stream)) !=
            cudaSuccess)
            return err;
        hp.s.part_ld = D;
        hp.s.part_o = (float *)parts;
        hp.s.part_lse = hp.s.part_o + slots * D;
    }
    cfg.gridDim = dim3((unsigned)(hp.s.ctas * CL));
    err = cudaLaunchKernelEx(&cfg, kernel, hp);
    if (err == cudaSuccess && hp.s.sk_tiles > 0) {
        cudaLaunchAttribute early;
        early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        early.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cc = {};
        cc.gridDim =
            dim3((unsigned)(hp.s.sk_tiles * CL),
                 (unsigned)((TL::BM * (D / COMBINE_COLS) + COMBINE_THREADS - 1) / COMBINE_THREADS));
        cc.blockDim = dim3(COMBINE_THREADS);
        cc.stream = stream;
        cc.attrs = &early;
        cc.numAttrs = 1;
        err = cudaLaunchKernelEx(&cc, combine_kernel, (const flash_params)hp.p,
                                 (const hopper_sched)hp.s, (int)TL::BM, hp.o_vec);
    }
    if (parts)
        cudaFreeAsync(parts, stream);
    return err;
}

/* Where an FP8 call's V^T lies (vt_kernel): extents and element strides of
 * [batch, kv head, channel, column]. */
struct vt_view {
    void *data;
    int64_t dims[4], strides[3]; /* innermost first */
};

/* The tensor maps, then the kernel variant: dropout, or two-level
 * accumulation (FP8 at D <= 128 only: it holds one tile's P V beside O,
 * which at D = 256, or with dropout's draws at D = 128, spills: ptxas, 380
 * bytes), or clusters, or none of them — as the call's plan says. */
template <int D, int IN>
fmha_status launch(hopper_params &hp, const fmha_plan *plan, const fmha_problem *pb,
                   const vt_view *vt, cudaStream_t stream)
{
    typedef htile<D, IN> TL;
    const fmha_forward_args *a = pb->args;
    hp.tau = lazy_tau(IN);
    fmha_status st;
    const fmha_schedule mode = plan->knobs.schedule;
    const int64_t max_sq = pb->max_sq;
    const int batch = (int)pb->batch;
    constexpr bool TWO = TL::FP8 && D <= 128;
    constexpr int CL2 = TL::FP8 || D < 128 ? 1 : 2; /* clusters: 16-bit variants at D >= 128 */
    const bool cl = CL2 > 1 && plan->cluster == CL2;
    /* In clusters each block loads half of a K/V tile's rows. */
    const int kv_rows = cl ? TL::BN / CL2 : TL::BN;
    if ((st = make_map(&hp.tq, a->q, TL::BM, IN, "q")) != FMHA_STATUS_OK ||
        (st = make_map(&hp.tk, a->k, kv_rows, IN, "k")) != FMHA_STATUS_OK)
        return st;
    st = TL::FP8 ? make_map_raw(&hp.tv, vt->data, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, vt->dims,
                                vt->strides, D, "v^t")
                 : make_map(&hp.tv, a->v, kv_rows, IN, "v");
    if (st != FMHA_STATUS_OK)
        return st;
    /* Unpacked 16-bit out with a region of its own to stage O in: written by
     * bulk tensor stores. Not packed batches (a box's rows past its sequence
     * are the next sequence's), nor O staged in Q's rows (the next piece's Q
     * would have to wait for the stores to read them). */
    hp.o_tma = hp.o_vec && !hp.p.varlen && TL::O_BYTES != 0;
    if (hp.o_tma &&
        (st = make_map(&hp.to, a->out, 64, a->out.dtype == FMHA_DTYPE_BF16 ? IN_BF16 : IN_F16,
                       "out")) != FMHA_STATUS_OK)
        return st;
    const cudaError_t err =
        hp.p.drop_threshold ? launch_variant<D, IN, true, false, 1>(hp, max_sq, batch, mode, stream)
        : plan->two_level && TWO
            ? launch_variant<D, IN, false, TWO, 1>(hp, max_sq, batch, mode, stream)
        : cl ? launch_variant<D, IN, false, false, CL2>(hp, max_sq, batch, mode, stream)
             : launch_variant<D, IN, false, false, 1>(hp, max_sq, batch, mode, stream);
    return err == cudaSuccess ? FMHA_STATUS_OK
                              : cuda_error(err, "the Hopper attention kernel launch");
}

/* The plan's compiled head dim; vt != NULL for FP8. */
fmha_status launch_head_dim(hopper_params &hp, const fmha_plan *plan, const fmha_problem *pb,
                            const vt_view *vt, cudaStream_t stream)
{
    const bool bf16 = plan->cfg.dtype == FMHA_DTYPE_BF16;
#define FMHA_LAUNCH(D)                                             \
    if (plan->head_dim_variant == D)                               \
        return bf16 ? launch<D, IN_BF16>(hp, plan, pb, vt, stream) \
                    : launch<D, IN_F16>(hp, plan, pb, vt, stream);
#define FMHA_LAUNCH_FP8(D)                                                 \
    if (plan->head_dim_variant == D)                                       \
        return plan->int8_qk ? launch<D, IN_S8Q>(hp, plan, pb, vt, stream) \
                             : launch<D, IN_E4M3>(hp, plan, pb, vt, stream);
    if (vt) {
        FMHA_CUDA_FP8_HEAD_DIMS(FMHA_LAUNCH_FP8)
    } else {
        FMHA_CUDA_HEAD_DIMS(FMHA_LAUNCH)
    }
#undef FMHA_LAUNCH
#undef FMHA_LAUNCH_FP8
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED, "head dim variant %d is not compiled",
                          plan->head_dim_variant);
}

hopper_params params_of(const fmha_problem *pb, const flash_params &p)
{
    hopper_params h;
    memset(&h, 0, sizeof h);
    h.p = p;
    h.o_vec = pb->args->out.dtype != FMHA_DTYPE_F32 && chunk_aligned(pb->args->out);
    return h;
}

} // namespace

namespace fmha_cuda
{

/* The variant of a plan: the smallest compiled head dim that holds it, and
 * that variant's tile, clusters and two-level accumulation. */
fmha_status hopper_variant(fmha_plan *plan)
{
    const int64_t dmax =
        plan->cfg.head_dim > plan->cfg.head_dim_v ? plan->cfg.head_dim : plan->cfg.head_dim_v;
#define FMHA_VARIANT(D, IN)                             \
    if (dmax <= D) {                                    \
        typedef htile<D, IN> TL;                        \
        plan->head_dim_variant = D;                     \
        plan->tile_m = TL::BM;                          \
        plan->tile_n = TL::BN;                          \
        plan->max_cluster = TL::FP8 || D < 128 ? 1 : 2; \
        plan->has_two_level = TL::FP8 && D <= 128;      \
        return FMHA_STATUS_OK;                          \
    }
#define FMHA_VARIANT_16(D)  FMHA_VARIANT(D, IN_BF16)
#define FMHA_VARIANT_FP8(D) FMHA_VARIANT(D, IN_E4M3)
    if (plan->cfg.dtype == FMHA_DTYPE_F8_E4M3) {
        FMHA_CUDA_FP8_HEAD_DIMS(FMHA_VARIANT_FP8)
    } else {
        FMHA_CUDA_HEAD_DIMS(FMHA_VARIANT_16)
    }
#undef FMHA_VARIANT
#undef FMHA_VARIANT_16
#undef FMHA_VARIANT_FP8
    return fmha_set_error(FMHA_STATUS_UNSUPPORTED,
                          "head dim %lld is above 256, the largest CUDA kernel", (long long)dmax);
}

fmha_status hopper_forward(const fmha_plan *plan, const fmha_problem *pb, const flash_params &p,
                           cudaStream_t stream)
{
    hopper_params h = params_of(pb, p);
    return launch_head_dim(h, plan, pb, nullptr, stream);
}

/* FP8: V^T into pooled scratch on the stream, then the kernel; the scratch
 * goes back to the pool behind the kernel. */
fmha_status hopper_fp8_forward(const fmha_plan *plan, const fmha_problem *pb, const flash_params &p,
                               cudaStream_t stream)
{
    fmha_status st;
    const fmha_forward_args *a = pb->args;
    hopper_params h = params_of(pb, p);
    /* P <= 2^tau (the lazy max), times drop_scale after dropout: scaled by
     * 2^shift it stays below e4m3's 448. */
    const double pmax = (pb->drop_threshold ? pb->drop_rescale : 1.0) * exp2(lazy_tau(IN_E4M3));
    h.p_shift = (float)fmin(8.0, floor(log2(448.0 / pmax)));

    const int64_t nseq = pb->batch, kvh = pb->kv_heads, dv = pb->dv;
    const int64_t cols = p.varlen ? vt_start(a->k.seqlen, nseq) : (a->k.seqlen + 15) & ~(int64_t)15;
    const int64_t vt_batch = p.varlen ? 1 : nseq;
    vt_view vt = {nullptr, {cols, dv, kvh, vt_batch}, {cols, dv * cols, kvh * dv * cols}};
    cudaError_t err = scratch_alloc(&vt.data, (size_t)(vt_batch * kvh * dv * cols), stream);
    if (err != cudaSuccess)
        return cuda_error(err, "allocating V^T scratch for FP8 attention");
    const fmha_tensor &v = a->v;
    const int vec4 =
        dv % 4 == 0 && (uintptr_t)v.data % 4 == 0 && (v.stride_seq % 4 == 0 || v.seqlen == 1) &&
        (v.stride_head % 4 == 0 || v.heads == 1) && (v.stride_batch % 4 == 0 || v.batch == 1);
    const int64_t max_own = p.varlen ? (pb->max_sk + 15 + 32) & ~(int64_t)15 : cols;
    dim3 grid((unsigned)((max_own + VT_COLS - 1) / VT_COLS), (unsigned)kvh, (unsigned)nseq);
    vt_kernel<<<grid, 256, 0, stream>>>(p, (uint8_t *)vt.data, cols, vec4);
    if ((err = cudaGetLastError()) != cudaSuccess)
        st = cuda_error(err, "the FP8 V^T kernel launch");
    else
        st = launch_head_dim(h, plan, pb, &vt, stream);
    cudaFreeAsync(vt.data, stream);
    return st;
}

} // namespace fmha_cuda
