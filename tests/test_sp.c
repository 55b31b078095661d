/* test_sp.c — sequence parallelism without a communicator: which tokens
 * each rank holds (every split and layout partitions the sequence, zigzag
 * pairs chunk i with 2r - 1 - i, uneven sizes differ by a token), the
 * communicator's refusals (a kind this build lacks names the fix), and
 * fmha_sp_tokens' own. */
#include "testutil.h"

#include <stdlib.h>
#include <string.h>

static void test_partition(int64_t s, int u, int r, fmha_sp_layout layout)
{
    fmha_sp_config sp;
    fmha_sp_config_init(&sp, u, r);
    sp.layout = layout;
    char *seen = calloc((size_t)s + 1, 1);
    int ok = 1;
    int64_t lo = s, hi = 0;
    for (int p = 0; p < u * r; p++) {
        int64_t start[2], len[2];
        int nseg;
        if (fmha_sp_tokens(&sp, s, p, start, len, &nseg) != FMHA_STATUS_OK) {
            TU_CHECK(0, "tokens: %s", fmha_last_error());
            break;
        }
        int64_t n = 0;
        for (int i = 0; i < nseg; i++)
            for (int64_t j = 0; j < len[i]; j++) {
                const int64_t t = start[i] + j;
                ok &= t >= 0 && t < s && !seen[t];
                if (t >= 0 && t < s)
                    seen[t] = 1;
                n++;
            }
        lo = n < lo ? n : lo;
        hi = n > hi ? n : hi;
        if (layout == FMHA_SP_LAYOUT_ZIGZAG && u == 1 && s >= 2 * r) {
            /* slot p: chunks p and 2r - 1 - p */
            ok &= start[0] == s * p / (2 * r);
            ok &= nseg == 1 ? p == r - 1 : start[1] == s * (2 * r - 1 - p) / (2 * r);
        }
    }
    for (int64_t t = 0; t < s; t++)
        ok &= seen[t];
    TU_CHECK(ok, "s=%lld u=%d r=%d %s: the ranks' tokens do not partition the sequence",
             (long long)s, u, r, layout ? "zigzag" : "contiguous");
    TU_CHECK(hi - lo <= (layout == FMHA_SP_LAYOUT_ZIGZAG ? 2 + u : 1) || s < u * r,
             "s=%lld u=%d r=%d: ranks hold %lld to %lld tokens", (long long)s, u, r, (long long)lo,
             (long long)hi);
    free(seen);
}

static void expect(fmha_status got, fmha_status want, const char *msg)
{
    TU_CHECK(got == want && strstr(fmha_last_error(), msg), "expected %s \"%s\", got %s: %s",
             fmha_status_string(want), msg, fmha_status_string(got), fmha_last_error());
}

int main(void)
{
    const int64_t sizes[] = {0, 1, 7, 113, 239, 1023, 75600};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        for (int u = 1; u <= 8; u *= 2)
            for (int r = 1; r <= 8; r++)
                for (int l = 0; l < 2; l++)
                    test_partition(sizes[i], u, r, (fmha_sp_layout)l);

    fmha_sp_config sp;
    fmha_sp_config_init(&sp, 2, 3);
    int64_t start[2], len[2];
    int nseg;
    expect(fmha_sp_tokens(&sp, 10, 6, start, len, &nseg), FMHA_STATUS_INVALID_ARGUMENT,
           "rank (6) must be in [0, 6)");
    expect(fmha_sp_tokens(&sp, -1, 0, start, len, &nseg), FMHA_STATUS_INVALID_ARGUMENT,
           "seqlen (-1) must be in [0, 2^40]");
    sp.ulysses = 0;
    expect(fmha_sp_tokens(&sp, 10, 0, start, len, &nseg), FMHA_STATUS_INVALID_ARGUMENT,
           "ulysses (0) must be in [1, 65536]");

    fmha_comm *comm = (fmha_comm *)&sp;
    int handle = 0;
    expect(fmha_comm_init(&comm, (fmha_comm_kind)7, &handle, NULL), FMHA_STATUS_INVALID_ARGUMENT,
           "kind (7) is not a fmha_comm_kind value");
    TU_CHECK(comm == NULL, "a refused fmha_comm_init leaves *comm NULL");
    expect(fmha_comm_init(&comm, FMHA_COMM_MPI, NULL, NULL), FMHA_STATUS_INVALID_ARGUMENT,
           "handle is NULL: pass the address of your MPI_Comm");
    expect(fmha_comm_init(&comm, FMHA_COMM_MPI, &handle, &handle), FMHA_STATUS_INVALID_ARGUMENT,
           "stream is given for an MPI communicator");
    if (!fmha_comm_built(FMHA_COMM_NCCL))
        expect(fmha_comm_init(&comm, FMHA_COMM_NCCL, &handle, NULL), FMHA_STATUS_UNSUPPORTED,
               "this fmha was built without NCCL");
    if (!fmha_comm_built(FMHA_COMM_MPI))
        expect(fmha_comm_init(&comm, FMHA_COMM_MPI, &handle, NULL), FMHA_STATUS_UNSUPPORTED,
               "this fmha was built without MPI");
    TU_CHECK(fmha_comm_rank(NULL) == -1 && fmha_comm_size(NULL) == -1, "NULL comm: -1");
    fmha_comm_free(NULL);
    TU_CHECK(!strcmp(fmha_comm_kind_name(FMHA_COMM_MPI), "mpi") &&
                 !strcmp(fmha_comm_kind_name(FMHA_COMM_NCCL), "nccl"),
             "kind names");
    return tu_summary();
}
