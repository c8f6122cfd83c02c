/* The CPU thread pool (threads.h). */
#define _POSIX_C_SOURCE 200809L /* O_CLOEXEC under -std=c11 */
#include "threads.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <unistd.h>

#define MAX_THREADS 256

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER; /* workers: a new job */
static pthread_cond_t done = PTHREAD_COND_INITIALIZER; /* the caller: its helpers left */
static int workers;    /* started, never stopped (they sleep) */
static int busy;       /* a call holds the pool */
static uint64_t generation;
static atomic_int setting; /* gvr_set_num_threads: 0 = default */

/* the current job; fields other than the atomics change under mu while no helper runs */
static struct {
    gvr_row_fn fn;
    void *ctx;
    int64_t rows;
    atomic_llong next;
    atomic_int failed;
    int open_slots; /* helpers that may still join */
    int running;    /* helpers inside run_rows */
} job;

static void run_rows(void)
{
    for (;;) {
        const int64_t r = atomic_fetch_add_explicit(&job.next, 1, memory_order_relaxed);
        if (r >= job.rows)
            return;
        if (job.fn(job.ctx, r))
            atomic_store_explicit(&job.failed, 1, memory_order_relaxed);
    }
}

/* arg: the generation when it was created (under mu), so the job that created it is not missed */
static void *worker(void *arg)
{
    uint64_t seen = (uint64_t)(uintptr_t)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (generation == seen)
            pthread_cond_wait(&wake, &mu);
        seen = generation;
        if (job.open_slots <= 0)
            continue; /* enough helpers joined, or the caller finished the rows already */
        job.open_slots--;
        job.running++;
        pthread_mutex_unlock(&mu);
        run_rows();
        pthread_mutex_lock(&mu);
        if (--job.running == 0)
            pthread_cond_signal(&done);
    }
    return NULL;
}

/* a forked child has no workers (and the pool may have been held mid-call by another thread) */
static void after_fork_child(void)
{
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&done, NULL);
    workers = 0;
    busy = 0;
}

static int online_cpus(void)
{
    static atomic_int cached; /* sysconf reads a /sys file each time */
    int n = atomic_load_explicit(&cached, memory_order_relaxed);
    if (n == 0) {
        const long m = sysconf(_SC_NPROCESSORS_ONLN);
        n = m < 1 ? 1 : m > MAX_THREADS ? MAX_THREADS : (int)m;
        atomic_store_explicit(&cached, n, memory_order_relaxed);
    }
    return n;
}

/* CPUs with nothing to run right now: the online CPUs minus the runnable threads of the whole
 * machine, the caller included (the 4th field of /proc/loadavg, "running/total"; a pread of a file
 * kept open, 2 us). Waking a helper when there is none costs the caller its CPU for a scheduler slice
 * (ms). When the count cannot be read, every other CPU is taken as idle. */
static int idle_cpus(void)
{
    static atomic_int loadavg_fd = -2; /* -2: not opened yet, -1: cannot be */
    int fd = atomic_load(&loadavg_fd);
    if (fd == -2) {
        int mine = open("/proc/loadavg", O_RDONLY | O_CLOEXEC), expected = -2;
        if (!atomic_compare_exchange_strong(&loadavg_fd, &expected, mine) && mine >= 0)
            close(mine); /* another thread opened it first */
        fd = atomic_load(&loadavg_fd);
    }
    char buf[128];
    const ssize_t len = fd >= 0 ? pread(fd, buf, sizeof buf - 1, 0) : -1;
    if (len <= 0)
        return online_cpus() - 1;
    buf[len] = 0;
    const char *p = buf;
    for (int field = 0; field < 3 && p; field++) {
        p = strchr(p, ' ');
        p = p ? p + 1 : NULL;
    }
    const long running = p ? strtol(p, NULL, 10) : 0;
    return running < 1 ? online_cpus() - 1 : online_cpus() - (int)running;
}

void gvr_set_num_threads(int n) { atomic_store(&setting, n < 0 ? 0 : n > MAX_THREADS ? MAX_THREADS : n); }

int gvr_get_num_threads(void)
{
    const int n = atomic_load(&setting);
    return n > 0 ? n : online_cpus();
}

static int serial(int64_t rows, gvr_row_fn fn, void *ctx)
{
    int failed = 0;
    for (int64_t r = 0; r < rows; r++)
        failed |= fn(ctx, r) != 0;
    return failed ? -1 : 0;
}

int gvr_parallel_rows(int64_t rows, int64_t work, gvr_row_fn fn, void *ctx)
{
    int64_t nt = gvr_get_num_threads();
    if (nt > rows)
        nt = rows;
    if (nt <= 1 || work < GVR_PARALLEL_MIN_WORK)
        return serial(rows, fn, ctx);
    if (atomic_load(&setting) == 0) { /* the default: helpers for idle CPUs only */
        const int idle = idle_cpus();
        if (nt - 1 > idle)
            nt = idle + 1;
        if (nt <= 1)
            return serial(rows, fn, ctx);
    }
    pthread_mutex_lock(&mu);
    if (busy) { /* another Python thread's call: don't wait for it */
        pthread_mutex_unlock(&mu);
        return serial(rows, fn, ctx);
    }
    static int fork_handler;
    if (!fork_handler)
        fork_handler = pthread_atfork(NULL, NULL, after_fork_child) == 0;
    while (workers < nt - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker, (void *)(uintptr_t)generation);
        pthread_attr_destroy(&attr);
        if (rc)
            break; /* fewer helpers */
        workers++;
    }
    busy = 1;
    job.fn = fn;
    job.ctx = ctx;
    job.rows = rows;
    atomic_store(&job.next, 0);
    atomic_store(&job.failed, 0);
    job.open_slots = (int)(nt - 1 < workers ? nt - 1 : workers);
    job.running = 0;
    generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);

    run_rows();

    pthread_mutex_lock(&mu);
    job.open_slots = 0; /* helpers that wake from now on find nothing to do */
    while (job.running > 0)
        pthread_cond_wait(&done, &mu);
    busy = 0;
    const int failed = atomic_load(&job.failed);
    pthread_mutex_unlock(&mu);
    return failed ? -1 : 0;
}
