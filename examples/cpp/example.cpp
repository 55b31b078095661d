// example.cpp — fmha.h from C++: the same C API (the header declares it
// extern "C"), with the layer owned by a std::unique_ptr. A sliding-window
// layer on random bf16 inputs in BHSD memory (torch's [B, H, S, D]), its
// output and LSE checked against the float64 reference. Exits 0 when they
// agree, 1 otherwise.
#include <fmha.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

namespace
{

const int64_t batch = 1, seqlen = 300, heads = 4, head_dim = 128;

using layer_ptr = std::unique_ptr<fmha_layer, decltype(&fmha_layer_free)>;

std::vector<uint16_t> random_bf16(size_t n, std::mt19937 &gen)
{
    std::normal_distribution<float> normal;
    std::vector<uint16_t> x(n);
    for (auto &e : x)
        e = fmha_f32_to_bf16(normal(gen));
    return x;
}

int fail(const char *what, fmha_status st)
{
    std::fprintf(stderr, "example: %s: %s: %s\n", what, fmha_status_string(st), fmha_last_error());
    return 1;
}

} // namespace

int main()
{
    fmha_config cfg;
    fmha_config_init(&cfg, heads, heads, head_dim);
    cfg.window_left = 64; // each query sees the 64 keys before it and itself
    cfg.window_right = 0;

    fmha_layer *raw = nullptr;
    fmha_status st = fmha_layer_init(&raw, &cfg);
    if (st != FMHA_STATUS_OK)
        return fail("fmha_layer_init", st);
    layer_ptr layer(raw, fmha_layer_free);

    std::mt19937 gen(42);
    size_t n = size_t(batch * seqlen * heads * head_dim);
    std::vector<uint16_t> q = random_bf16(n, gen), k = random_bf16(n, gen), v = random_bf16(n, gen);
    std::vector<float> out(n), ref(n), lse(size_t(batch * heads * seqlen)), lse_ref(lse.size());

    fmha_forward_args a{};
    a.q = fmha_tensor_bhsd(q.data(), FMHA_DTYPE_BF16, batch, seqlen, heads, head_dim);
    a.k = fmha_tensor_bhsd(k.data(), FMHA_DTYPE_BF16, batch, seqlen, heads, head_dim);
    a.v = fmha_tensor_bhsd(v.data(), FMHA_DTYPE_BF16, batch, seqlen, heads, head_dim);
    a.out = fmha_tensor_bhsd(out.data(), FMHA_DTYPE_F32, batch, seqlen, heads, head_dim);
    a.lse = lse.data();
    st = fmha_layer_forward(layer.get(), &a);
    if (st != FMHA_STATUS_OK)
        return fail("fmha_layer_forward", st);

    a.out.data = ref.data();
    a.lse = lse_ref.data();
    st = fmha_reference_forward(&cfg, &a);
    if (st != FMHA_STATUS_OK)
        return fail("fmha_reference_forward", st);

    double err = 0, scale = 0, lse_err = 0;
    for (size_t i = 0; i < n; i++) {
        err = std::max(err, std::fabs(double(out[i]) - ref[i]));
        scale = std::max(scale, std::fabs(double(ref[i])));
    }
    for (size_t i = 0; i < lse.size(); i++)
        lse_err = std::max(lse_err, std::fabs(double(lse[i]) - lse_ref[i]));
    bool ok = err <= 1e-2 * scale && lse_err <= 1e-3;
    char what[256];
    fmha_layer_describe(layer.get(), what, sizeof what);
    std::printf("%s\nmax |out - ref| = %.2g (max |ref| = %.2g), max |lse - ref| = %.2g: %s\n", what,
                err, scale, lse_err, ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}
