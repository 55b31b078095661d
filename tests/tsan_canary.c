/* tsan_canary.c — a deliberate data race for the ThreadSanitizer build
 * (FMHA_SANITIZE=thread). Its test passes only when TSan reports the race, so
 * a setup that stops seeing races (a flag lost, Archer not loaded, libgomp
 * linked instead of libomp) fails instead of passing quietly. */
#include <stdio.h>

int main(void)
{
    int hits = 0;
#pragma omp parallel num_threads(2)
    hits++; /* both threads read and write `hits` unsynchronized: the race */
    printf("hits %d\n", hits);
    return 0;
}
