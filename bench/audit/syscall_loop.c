/* The per-syscall cost of an audit context: CPU time per getppid(), best of
 * 30 runs of 10^6 calls (CPU time, so other load on the host does not count).
 * Used by audit_cost.py; see docs/security.md "Landlock denial events". */
#define _GNU_SOURCE
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(void) {
    double best = 1e18;
    for (int r = 0; r < 30; r++) {
        const long n = 1000000;
        double t = cpu_ns();
        for (long i = 0; i < n; i++)
            syscall(SYS_getppid);
        t = (cpu_ns() - t) / n;
        if (t < best)
            best = t;
    }
    printf("%.1f\n", best);
    return 0;
}
