/* torch_ext.cpp — the compiled path of fmha.attention and
 * fmha.varlen_attention (and fmha.Attention's forwards) for torch tensors:
 * the fmha_torch_ext module that fmha/torch_ext.py builds against the
 * installed torch. attention() and varlen_attention() take the call as the
 * Python function got it and run it on libfmha when it is the common case:
 * plain CPU or CUDA tensors, f32/f16/bf16, no dropout, out=, descales or
 * score modifiers, no torch dispatch or function mode. A call that autograd
 * would record gets False (fmha/torch_ext.py's autograd Functions run it
 * here again with grad off); any other call, and any call libfmha refuses,
 * gets None, so that the Python path runs it and raises its own error: this
 * file checks types and nothing else, the library validates.
 *
 * libfmha is the one fmha/_lib.py loaded: bind() receives the addresses of
 * the four functions it calls, so the module links no libfmha of its own.
 * Layers are kept per thread, keyed by configuration, device and the
 * environment's knobs (as fmha/_api.py keeps its one-shot layers). */
#include <torch/extension.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#ifdef FMHA_EXT_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fmha.h"

namespace
{

struct Library {
    decltype(&fmha_config_init) config_init = nullptr;
    decltype(&fmha_layer_init) layer_init = nullptr;
    decltype(&fmha_layer_free) layer_free = nullptr;
    decltype(&fmha_layer_forward) layer_forward = nullptr;
    std::vector<std::string> knobs;
};
Library lib;

struct KeptLayer {
    fmha_config cfg;
    int device;
    std::string knobs;
    fmha_layer *layer;
};
constexpr size_t kKeptLayers = 32; /* per thread, least recently used out first */

/* The knobs' values as one string, unset and empty told apart. */
std::string knob_values()
{
    std::string s;
    for (const auto &name : lib.knobs) {
        const char *v = std::getenv(name.c_str());
        s += v ? std::string(v) + '\x1e' : std::string("\x1f");
    }
    return s;
}

/* The thread's layer for cfg on `device` (-1: CPU) under the knobs' values
 * `knobs`, or nullptr where libfmha refuses to make one. The front of the
 * list is the most recent. */
fmha_layer *kept_layer(const fmha_config &cfg, int device, const std::string &knobs)
{
    /* CPU layers go with their thread; CUDA ones stay (a thread's end may
     * come after CUDA's, at the process's exit). */
    struct List : std::vector<KeptLayer> {
        ~List()
        {
            for (const auto &e : *this)
                if (e.device < 0)
                    lib.layer_free(e.layer);
        }
    };
    thread_local List kept;
    for (size_t i = 0; i < kept.size(); i++) {
        if (kept[i].device == device && !std::memcmp(&kept[i].cfg, &cfg, sizeof cfg) &&
            kept[i].knobs == knobs) {
            KeptLayer hit = kept[i];
            kept.erase(kept.begin() + (long)i);
            kept.insert(kept.begin(), hit);
            return hit.layer;
        }
    }
    fmha_layer *layer = nullptr;
    if (lib.layer_init(&layer, &cfg) != FMHA_STATUS_OK)
        return nullptr;
    if (kept.size() == kKeptLayers) {
        lib.layer_free(kept.back().layer);
        kept.pop_back();
    }
    kept.insert(kept.begin(), KeptLayer{cfg, device, knobs, layer});
    return layer;
}

/* A tensor the library can read as it is: plain (no subclass, functorch
 * wrapper, lazy negation or conjugation), strided, on the CPU or a CUDA
 * device, `ndim`-d with the last dim contiguous and no negative stride. */
bool plain_tensor(PyObject *obj, at::Tensor &t, int ndim = 4)
{
    if (!THPVariable_Check(obj))
        return false;
    t = THPVariable_Unpack(obj);
    const c10::DispatchKeySet ks = t.key_set();
    if (ks.has(c10::DispatchKey::Python) || ks.has(c10::DispatchKey::PythonTLSSnapshot) ||
        ks.has(c10::DispatchKey::FuncTorchBatched) || ks.has(c10::DispatchKey::Functionalize) ||
        t.is_neg() || t.is_conj() || t.layout() != at::kStrided || !t.has_storage())
        return false;
    if (!t.device().is_cpu() && !t.device().is_cuda())
        return false;
    if (t.dim() != ndim || (t.stride(ndim - 1) != 1 && t.size(ndim - 1) > 1))
        return false;
    for (int i = 0; i < ndim; i++)
        if (t.stride(i) < 0)
            return false;
    return true;
}

bool dtype_of(const at::Tensor &t, fmha_dtype &d)
{
    switch (t.scalar_type()) {
    case at::kFloat: d = FMHA_DTYPE_F32; return true;
    case at::kHalf: d = FMHA_DTYPE_F16; return true;
    case at::kBFloat16: d = FMHA_DTYPE_BF16; return true;
    default: return false;
    }
}

/* [B, S, H, D] as it is; packed [T, H, D] as batch 1 (fmha_tensor_packed's
 * convention). */
fmha_tensor view(const at::Tensor &t, fmha_dtype d)
{
    const int o = t.dim() == 4 ? 1 : 0; /* dims before the sequence's */
    fmha_tensor v;
    std::memset(&v, 0, sizeof v);
    v.data = t.data_ptr();
    v.dtype = d;
    v.batch = o ? t.size(0) : 1;
    v.seqlen = t.size(o);
    v.heads = t.size(o + 1);
    v.head_dim = t.size(o + 2);
    v.stride_batch = o ? t.stride(0) : 0;
    v.stride_seq = t.stride(o);
    v.stride_head = t.stride(o + 1);
    v.stride_dim = 1;
    return v;
}

/* A Python number as a double: int or float, never bool. */
bool real(PyObject *obj, double &x)
{
    if (PyBool_Check(obj) || !(PyFloat_Check(obj) || PyLong_Check(obj)))
        return false;
    x = PyFloat_AsDouble(obj);
    if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    return true;
}

bool int64(PyObject *obj, int64_t &x)
{
    if (PyBool_Check(obj) || !PyLong_Check(obj))
        return false;
    int overflow = 0;
    x = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    return true;
}

/* The options as _Options takes them, or false for anything else. */
bool options(fmha_config &cfg, py::handle causal, py::handle scale, py::handle window,
             py::handle softcap)
{
    if (!PyBool_Check(causal.ptr()))
        return false;
    cfg.causal = causal.ptr() == Py_True;
    cfg.softmax_scale = 0.0; /* None: 1 / sqrt(head_dim) */
    if (!scale.is_none() && (!real(scale.ptr(), cfg.softmax_scale) || cfg.softmax_scale == 0.0))
        return false;
    cfg.window_left = cfg.window_right = -1;
    if (!window.is_none()) {
        PyObject *w = window.ptr();
        if (!(PyTuple_Check(w) || PyList_Check(w)) || PySequence_Fast_GET_SIZE(w) != 2)
            return false;
        if (!int64(PySequence_Fast_GET_ITEM(w, 0), cfg.window_left) ||
            !int64(PySequence_Fast_GET_ITEM(w, 1), cfg.window_right))
            return false;
    }
    cfg.softcap = 0.0;
    return softcap.is_none() || real(softcap.ptr(), cfg.softcap);
}

/* No torch dispatch or function mode that would have to see the call. */
bool unobserved()
{
    return !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
           !at::impl::torch_function_mode_enabled();
}

/* One call's inputs: q, k, v checked (`ndim`-d, one dtype, one device, no
 * observer), their dtype, the config of their shape and the options; false
 * for a call the Python path takes. */
struct Call {
    at::Tensor q, k, v;
    fmha_dtype dtype;
    fmha_config cfg;
    int device; /* CUDA ordinal, -1 for the CPU */
    bool grad;  /* autograd would record the call (grad mode on, an input requires grad) */
};

/* `layer`: None, or an fmha.Attention's (num_heads, num_kv_heads,
 * head_size), which the tensors must have (else the Python path refuses
 * them with the layer's message). */
bool layer_shape(py::handle layer, const Call &c, int o)
{
    if (layer.is_none())
        return true;
    PyObject *t = layer.ptr();
    int64_t h, hkv, d;
    return PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 3 && int64(PyTuple_GET_ITEM(t, 0), h) &&
           int64(PyTuple_GET_ITEM(t, 1), hkv) && int64(PyTuple_GET_ITEM(t, 2), d) &&
           c.q.size(o + 1) == h && c.k.size(o + 1) == hkv && c.v.size(o + 1) == hkv &&
           c.q.size(o + 2) == d && c.k.size(o + 2) == d;
}

bool prepare(Call &c, int ndim, py::handle qo, py::handle ko, py::handle vo, py::handle causal,
             py::handle scale, py::handle window, py::handle softcap, py::handle return_lse,
             py::handle layer)
{
    fmha_dtype kd, vd;
    if (!lib.layer_forward || !plain_tensor(qo.ptr(), c.q, ndim) ||
        !plain_tensor(ko.ptr(), c.k, ndim) || !plain_tensor(vo.ptr(), c.v, ndim) ||
        !PyBool_Check(return_lse.ptr()))
        return false;
    if (!dtype_of(c.q, c.dtype) || !dtype_of(c.k, kd) || !dtype_of(c.v, vd) || kd != c.dtype ||
        vd != c.dtype)
        return false;
    if (c.k.device() != c.q.device() || c.v.device() != c.q.device() || !unobserved())
        return false;
    c.grad = at::GradMode::is_enabled() &&
             (c.q.requires_grad() || c.k.requires_grad() || c.v.requires_grad());
    for (const at::Tensor *t : {&c.q, &c.k, &c.v})
        if (t->numel() == 0)
            return false; /* the Python path answers empty calls */
    const int o = ndim - 3;
    if (!layer_shape(layer, c, o))
        return false;
    std::memset(&c.cfg, 0, sizeof c.cfg);
    lib.config_init(&c.cfg, c.q.size(o + 1), c.k.size(o + 1), c.q.size(o + 2));
    c.cfg.head_dim_v = c.v.size(o + 2);
    c.cfg.dtype = c.dtype;
    if (!options(c.cfg, causal, scale, window, softcap))
        return false;
    const bool cuda = c.q.device().is_cuda();
#ifndef FMHA_EXT_CUDA
    if (cuda)
        return false;
#endif
    c.cfg.device = cuda ? FMHA_DEVICE_CUDA : FMHA_DEVICE_CPU;
    c.device = cuda ? c.q.device().index() : -1;
    return true;
}

/* Runs a (out, lse filled in) on the call's device and the current stream;
 * false where libfmha refuses. */
bool run(const Call &c, fmha_forward_args &a)
{
    const std::string knobs = knob_values(); /* under the GIL, as os.environ changes */
#ifdef FMHA_EXT_CUDA
    c10::cuda::OptionalCUDAGuard guard;
    if (c.device >= 0) {
        guard.set_device(c.q.device());
        a.stream = c10::cuda::getCurrentCUDAStream(c.device).stream();
    }
#endif
    py::gil_scoped_release nogil;
    fmha_layer *layer = kept_layer(c.cfg, c.device, knobs);
    return layer && lib.layer_forward(layer, &a) == FMHA_STATUS_OK;
}

py::object result(const at::Tensor &out, const at::Tensor &lse, bool want_lse)
{
    if (want_lse)
        return py::make_tuple(out, lse);
    return py::cast(out);
}

/* fmha.attention(q, k, v, causal=, softmax_scale=, window=, softcap=,
 * return_lse=) for padded q, k, v [B, S, H, D] (and Attention.forward,
 * `layer` its shape): out, or (out, lse); False for a call that would take
 * this path but that autograd records (fmha/torch_ext.py's Function runs
 * it); None for a call the Python path takes. */
py::object attention(py::handle qo, py::handle ko, py::handle vo, py::handle causal,
                     py::handle scale, py::handle window, py::handle softcap, py::handle return_lse,
                     py::handle layer)
{
    Call c;
    if (!prepare(c, 4, qo, ko, vo, causal, scale, window, softcap, return_lse, layer))
        return py::none();
    if (c.grad)
        return py::bool_(false);
    const int64_t B = c.q.size(0), Sq = c.q.size(1), H = c.q.size(2), Dv = c.v.size(3);
    const bool want_lse = return_lse.ptr() == Py_True;
    at::Tensor out = at::empty({B, Sq, H, Dv}, c.q.options());
    at::Tensor lse =
        want_lse ? at::empty({B, H, Sq}, c.q.options().dtype(at::kFloat)) : at::Tensor();
    fmha_forward_args a;
    std::memset(&a, 0, sizeof a);
    a.q = view(c.q, c.dtype);
    a.k = view(c.k, c.dtype);
    a.v = view(c.v, c.dtype);
    a.out = view(out, c.dtype);
    a.lse = want_lse ? lse.data_ptr<float>() : nullptr;
    return run(c, a) ? result(out, lse, want_lse) : py::none();
}

/* Offsets as libfmha reads them: int32, contiguous, 1-d, on q's device. */
bool offsets(py::handle obj, const at::Tensor &q, at::Tensor &t)
{
    if (!plain_tensor(obj.ptr(), t, 1) || t.scalar_type() != at::kInt || !t.is_contiguous() ||
        t.device() != q.device())
        return false;
    return true;
}

/* A bound: None (0: libfmha finds it) or an int. */
bool bound(py::handle obj, int64_t &x)
{
    x = 0;
    return obj.is_none() || int64(obj.ptr(), x);
}

/* fmha.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
 * max_seqlen_k, causal=, ...) for packed q, k, v [T, H, D]: out [Tq, H, Dv]
 * (rows past the last sequence unwritten, as on the Python path), or (out,
 * lse [H, Tq]); False and None as attention()'s. */
py::object varlen_attention(py::handle qo, py::handle ko, py::handle vo, py::handle cuqo,
                            py::handle cuko, py::handle maxqo, py::handle maxko, py::handle causal,
                            py::handle scale, py::handle window, py::handle softcap,
                            py::handle return_lse, py::handle layer)
{
    Call c;
    at::Tensor cuq, cuk;
    fmha_forward_args a;
    std::memset(&a, 0, sizeof a);
    if (!prepare(c, 3, qo, ko, vo, causal, scale, window, softcap, return_lse, layer) ||
        !offsets(cuqo, c.q, cuq) || !offsets(cuko, c.q, cuk) || cuq.numel() != cuk.numel() ||
        cuq.numel() < 2 || !bound(maxqo, a.max_seqlen_q) || !bound(maxko, a.max_seqlen_k))
        return py::none();
    if (c.grad)
        return py::bool_(false);
    const int64_t Tq = c.q.size(0), H = c.q.size(1), Dv = c.v.size(2);
    const bool want_lse = return_lse.ptr() == Py_True;
    at::Tensor out = at::empty({Tq, H, Dv}, c.q.options());
    at::Tensor lse = want_lse ? at::empty({H, Tq}, c.q.options().dtype(at::kFloat)) : at::Tensor();
    a.q = view(c.q, c.dtype);
    a.k = view(c.k, c.dtype);
    a.v = view(c.v, c.dtype);
    a.out = view(out, c.dtype);
    a.lse = want_lse ? lse.data_ptr<float>() : nullptr;
    a.cu_seqlens_q = cuq.data_ptr<int32_t>();
    a.cu_seqlens_k = cuk.data_ptr<int32_t>();
    a.varlen_batch = cuq.numel() - 1;
    return run(c, a) ? result(out, lse, want_lse) : py::none();
}

/* The library's functions by address (fmha/_lib.py's), and the names of the
 * environment's knobs. */
void bind(uintptr_t config_init, uintptr_t layer_init, uintptr_t layer_free,
          uintptr_t layer_forward, std::vector<std::string> knobs)
{
    lib.config_init = reinterpret_cast<decltype(lib.config_init)>(config_init);
    lib.layer_init = reinterpret_cast<decltype(lib.layer_init)>(layer_init);
    lib.layer_free = reinterpret_cast<decltype(lib.layer_free)>(layer_free);
    lib.layer_forward = reinterpret_cast<decltype(lib.layer_forward)>(layer_forward);
    lib.knobs = std::move(knobs);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("bind", &bind);
    m.def("sizes", [] { return py::make_tuple(sizeof(fmha_config), sizeof(fmha_forward_args)); });
    m.def("attention", &attention);
    m.def("varlen_attention", &varlen_attention);
#ifdef FMHA_EXT_CUDA
    m.attr("cuda") = true;
#else
    m.attr("cuda") = false;
#endif
}
