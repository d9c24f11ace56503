/* A tiny pool of spinning helper threads for the block kernels.
 *
 * Why not OpenMP: the kernels are called ~120 times per decode step, each call
 * lasting tens of microseconds, from the engine's own thread. libgomp parks a
 * helper after a short spin once it manages more threads than there are CPUs (the
 * case as soon as two threads of one process have used OpenMP), and waking it costs
 * more than the call. These helpers spin between calls (2 ms by default, far longer
 * than the gaps inside a decode step), then sleep on a condition variable.
 *
 * run_parallel(job, parts) runs job(part, parts) for part = 0..parts-1: part 0 on the
 * calling thread, the others on helpers; it returns when all are done. One caller
 * uses the pool at a time; a concurrent caller runs every part itself.
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
 * omp_get_thread_num, omp_get_num_threads); use_openmp_helpers(1) then runs parts
 * on the calling thread's OpenMP team instead of these helpers, (0) goes back.
 * Returns whether OpenMP is now in use. */
void set_openmp_runtime(void *parallel, void *thread_num, void *num_threads);
int use_openmp_helpers(int on);

#endif
