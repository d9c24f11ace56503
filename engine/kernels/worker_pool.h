/* Where the native kernels run their parts: a tiny pool of spinning helper threads,
 * or the calling thread's OpenMP team (torch's libgomp).
 *
 * The pool serves steps whose torch ops run on one thread: the kernels are called
 * ~120 times per decode step, each call lasting tens of microseconds, and its helpers
 * spin between calls (2 ms by default, far longer than the gaps inside a step), then
 * sleep on a condition variable. One caller uses it at a time; a concurrent caller
 * runs every part itself.
 *
 * In steps where torch runs its own threads, torch's OpenMP helpers spin between its
 * ops on the other cores, and a pool helper would fight them; there the calling thread
 * switches (use_openmp_helpers(1)) to running the parts on its own OpenMP team.
 *
 * run_parallel(job, parts) runs job(part, parts) for part = 0..parts-1 and returns
 * when all are done; no part may wait for another (a team smaller than `parts` runs
 * several parts one after the other).
 */
#ifndef KVSERVE_WORKER_POOL_H
#define KVSERVE_WORKER_POOL_H

typedef void (*part_fn)(const void *job, int part, int parts);

void run_parallel(part_fn fn, const void *job, int parts);

/* How long idle helpers spin before sleeping. Spinning suits steps whose other work
 * is single-threaded; when torch runs its own threads between calls, spinning
 * helpers would take their cores, so the engine sets 0 for those steps. */
void set_helper_spin_ns(long long nanoseconds);

/* Hand over the OpenMP runtime torch loaded (addresses of GOMP_parallel,
 * omp_get_thread_num, omp_get_num_threads); use_openmp_helpers(1) then runs the
 * calling thread's parts on its OpenMP team instead of the pool, (0) goes back.
 * Per thread; returns whether OpenMP is now in use on this thread. */
void set_openmp_runtime(void *parallel, void *thread_num, void *num_threads);
int use_openmp_helpers(int on);

/* Items [0, items) cut into one range per part, taken one at a time: a part takes its
 * own range front to back, then helps the others from their fronts. When the OS
 * preempts one thread of a call (a busy host: the server's event loop, a client on
 * the same cores), the other parts finish its range, so the call waits for at most
 * the one item that thread is on, not its whole share. */
#include <stdatomic.h>
#include <stdint.h>

#define MAX_RANGES 128

typedef struct {
    _Alignas(64) atomic_llong next;      /* one cache line per range: no false sharing */
    int64_t end;
} SharedRange;

typedef struct {
    SharedRange range[MAX_RANGES];
    int count;
} WorkRanges;

static inline void work_ranges_init(WorkRanges *work, int64_t items, int parts) {
    work->count = parts < 1 ? 1 : parts > MAX_RANGES ? MAX_RANGES : parts;
    for (int r = 0; r < work->count; r++) {
        atomic_init(&work->range[r].next, items * r / work->count);
        work->range[r].end = items * (r + 1) / work->count;
    }
}

/* The next item for `part` (its own range first), with the end of the range it came
 * from in *limit; -1 once every item is taken. Any thread; items are independent. */
static inline int64_t work_ranges_take(WorkRanges *work, int part, int64_t *limit) {
    for (int i = 0; i < work->count; i++) {
        SharedRange *range = &work->range[(part + i) % work->count];
        if (atomic_load_explicit(&range->next, memory_order_relaxed) >= range->end) continue;
        const int64_t item = atomic_fetch_add_explicit(&range->next, 1, memory_order_relaxed);
        if (item < range->end) {
            *limit = range->end;
            return item;
        }
    }
    return -1;
}

#endif
