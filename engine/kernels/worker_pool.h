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

#endif
