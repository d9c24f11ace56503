/* The helper-thread pool declared in worker_pool.h. */
#include "worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_HELPERS 63
static atomic_llong spin_ns = 2000000LL;   /* 2 ms; see set_helper_spin_ns */
/* Per calling thread, whether its parts run on its OpenMP team (use_openmp_helpers):
 * an engine on another thread, in small steps, keeps the pool (an OpenMP team started
 * from its thread would be a second pool, see engine/kernels/cpu_threads.py). */
static _Thread_local int openmp_active;

static struct {
    pthread_mutex_t caller;          /* held by the one caller using the pool */
    pthread_mutex_t sleep_lock;      /* with `wake`: helpers sleeping after their spin */
    pthread_cond_t wake;
    atomic_long generation;          /* bumped once per run_parallel */
    atomic_int remaining;            /* helpers still working on this generation */
    int num_helpers;
    long first_seen[MAX_HELPERS + 1];  /* per helper: the generation current at its birth */
    part_fn fn;
    const void *job;
    int parts;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long wait_for_work(long seen) {
    long generation;
    int64_t deadline = now_ns() + atomic_load_explicit(&spin_ns, memory_order_relaxed);
    for (int spins = 0;; spins++) {
        generation = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (generation != seen) return generation;
        CPU_RELAX();
        if ((spins & 1023) == 1023) {
            if (now_ns() > deadline) break;
            sched_yield();          /* let a runnable thread in on a busy host */
        }
    }
    pthread_mutex_lock(&pool.sleep_lock);
    while ((generation = atomic_load(&pool.generation)) == seen)
        pthread_cond_wait(&pool.wake, &pool.sleep_lock);
    pthread_mutex_unlock(&pool.sleep_lock);
    return generation;
}

void set_helper_spin_ns(long long nanoseconds) {
    atomic_store(&spin_ns, nanoseconds < 0 ? 0 : nanoseconds);
}

static void *helper_main(void *arg) {
    const int part = (int)(intptr_t)arg;          /* helper i runs part i + 1 */
    long seen = pool.first_seen[part];
    for (;;) {
        seen = wait_for_work(seen);
        if (part < pool.parts) pool.fn(pool.job, part, pool.parts);
        atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_release);
    }
    return NULL;
}

static void reset_after_fork(void) {    /* the child has none of the parent's helpers */
    pthread_mutex_init(&pool.caller, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.num_helpers = 0;
    openmp_active = 0;                  /* the forking thread's choice, now the child's */
}

static int grow_pool(int wanted) {      /* called with `caller` held */
    static int fork_handler_installed = 0;
    if (!fork_handler_installed) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        fork_handler_installed = 1;
    }
    while (pool.num_helpers < wanted && pool.num_helpers < MAX_HELPERS) {
        pthread_t thread;
        /* it waits for the generation after the current one, however late it starts */
        pool.first_seen[pool.num_helpers + 1] = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, helper_main, (void *)(intptr_t)(pool.num_helpers + 1)))
            break;
        pthread_detach(thread);
        pool.num_helpers++;
    }
    return pool.num_helpers;
}

/* The OpenMP runtime torch already loaded, handed over by set_openmp_runtime: in
 * steps where torch runs its own threads, its helpers spin between torch's ops, so
 * running our parts on them (GOMP_parallel is what `#pragma omp parallel` compiles
 * to) costs nothing to wake, while our own helpers would fight them for the cores. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_query_fn)(void);
static struct {
    gomp_parallel_fn parallel;
    omp_query_fn thread_num, num_threads;
} openmp;

void set_openmp_runtime(void *parallel, void *thread_num, void *num_threads) {
    openmp.parallel = (gomp_parallel_fn)parallel;
    openmp.thread_num = (omp_query_fn)thread_num;
    openmp.num_threads = (omp_query_fn)num_threads;
}

int use_openmp_helpers(int on) {
    openmp_active = on && openmp.parallel && openmp.thread_num && openmp.num_threads;
    return openmp_active;
}

struct openmp_job { part_fn fn; const void *job; int parts; };

static void openmp_body(void *arg) {         /* runs on every thread of the team */
    const struct openmp_job *run = arg;
    const int team = openmp.num_threads();
    for (int part = openmp.thread_num(); part < run->parts; part += team)
        run->fn(run->job, part, run->parts);
}

void run_parallel(part_fn fn, const void *job, int parts) {
    if (parts > 1 && openmp_active) {
        struct openmp_job run = {fn, job, parts};
        openmp.parallel(openmp_body, &run, (unsigned)parts, 0);
        return;
    }
    if (parts <= 1 || pthread_mutex_trylock(&pool.caller) != 0) {
        for (int part = 0; part < parts; part++) fn(job, part, parts);
        return;
    }
    int helpers = grow_pool(parts - 1);
    int runnable = helpers + 1 < parts ? helpers + 1 : parts;
    pool.fn = fn;
    pool.job = job;
    pool.parts = runnable;
    atomic_store_explicit(&pool.remaining, helpers, memory_order_relaxed);
    pthread_mutex_lock(&pool.sleep_lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep_lock);
    fn(job, 0, runnable);
    for (int spins = 1; atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0; spins++)
        if (spins & 1023) CPU_RELAX(); else sched_yield();
    pthread_mutex_unlock(&pool.caller);
}
