/* A small pool of CPU threads for row-parallel operators.
 *
 * Workers sleep on a condition variable between calls (passive: they never spin, so a loaded
 * machine loses nothing to busy-waiting); the calling thread takes rows too; rows are handed out
 * one at a time by an atomic counter, so each row is computed whole by one thread and results do
 * not depend on the thread count. Calls whose work (an estimate in elements, e.g. the sum of row
 * lengths) is below GVR_PARALLEL_MIN_WORK run serially on the calling thread: waking a worker costs
 * more than it saves there. With the default thread count, helpers are woken only for CPUs that are
 * idle at the call (the machine's
 * runnable threads, /proc/loadavg): on a loaded machine a woken helper waits for a CPU, and the
 * wake-up costs the caller its own for a scheduler slice (measured: 8 rows of 45 us took 2-10 ms
 * instead of 0.36; benchmarks/threads_notes.md). A call made while another Python thread's call
 * holds the pool runs serially too. */
#ifndef GVR_THREADS_H
#define GVR_THREADS_H

#include <stdint.h>

#ifndef GVR_PARALLEL_MIN_WORK /* -D to measure another threshold */
#define GVR_PARALLEL_MIN_WORK ((int64_t)1 << 18)
#endif

/* fn(ctx, row) for row in [0, rows); a nonzero return marks the call failed (the other rows still
 * run). Returns 0, or -1 if any row failed. */
typedef int (*gvr_row_fn)(void *ctx, int64_t row);
int gvr_parallel_rows(int64_t rows, int64_t work, gvr_row_fn fn, void *ctx);

/* Threads for CPU rows: n >= 1 (used as given, above the work threshold), or 0 for the default: up
 * to the number of online CPUs, helpers only for CPUs idle at the call. */
void gvr_set_num_threads(int n);
/* The count a call uses at most (the setting, or the default it stands for). */
int gvr_get_num_threads(void);

#endif
