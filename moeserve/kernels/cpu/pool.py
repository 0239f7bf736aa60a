"""The generated kernels' threads: one persistent pool of native helper threads per process, shared by every kernel
library (each gets the pool's entry points at load: `moeserve_set_pool`).

Why not OpenMP: a hybrid decode step calls a layer's CPU experts once per layer, ~0.3 ms of work each, and an
OpenMP region with sleeping (PASSIVE) threads pays a wake-up at its start and at every barrier inside - about as much
as the work itself on the Qwen3-30B-A3B shape - while spinning (ACTIVE) threads are process-wide: torch's own
OpenMP teams spin too and take the cores from the Python thread that launches the GPU's work. This pool spins only
inside a job (its barriers) and for a bounded window after one (`spin_us`: long enough to cover the GPU's part of a
layer between two CPU calls), then sleeps; and a job can run on the helpers alone while the calling thread goes on
(`start`/`wait`: the hybrid layer enqueues the GPU's work meanwhile, no Python worker thread in between).

Jobs are C functions `void job(void* ctx, int tid, int nth)` run for tid 0..nth-1; run(): the caller is tid 0.
One job at a time (a spin lock from start to wait). After a fork the child starts its own helpers on first use.
"""

from __future__ import annotations

import ctypes
import functools

from moeserve.kernels.cpu import build

SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() do { } while (0)
#endif

#define MAX_HELPERS 512
typedef void (*mp_job)(void* ctx, int tid, int nth);

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static atomic_uint gen;              /* +2 per job: odd while one is being published */
static atomic_int sleepers, done, helpers, lock_flag;
static _Atomic(uintptr_t) job_fn, job_ctx;
static atomic_int job_nth, job_first;
static long spin_ns = 100000;
static int cpus[MAX_HELPERS + 1], n_cpus;
static unsigned born[MAX_HELPERS + 1];

static long now_ns(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void* helper(void* arg) {
  const int h = (int)(intptr_t)arg;  /* 1-based */
  unsigned seen = born[h];  /* the jobs before this helper started are not its */
  int left_out = 0;  /* the last job had no part for this helper: sleep at once, spin only after a job it ran */
  for (;;) {
    long t0 = now_ns();
    unsigned spins = 0, g;
    if (left_out) {  /* its core may be another thread's (a run with fewer threads than helpers): don't spin there */
      pthread_mutex_lock(&mu);
      atomic_fetch_add(&sleepers, 1);
      while (atomic_load(&gen) == seen) pthread_cond_wait(&cv, &mu);
      atomic_fetch_sub(&sleepers, 1);
      pthread_mutex_unlock(&mu);
    }
    for (;;) {  /* a seqlock: gen is odd while a job is being published */
      g = atomic_load(&gen);
      if (g != seen && !(g & 1)) {
        const int first = atomic_load(&job_first), nth = atomic_load(&job_nth);
        mp_job fn = (mp_job)atomic_load(&job_fn);
        void* ctx = (void*)atomic_load(&job_ctx);
        if (atomic_load(&gen) != g) continue;  /* republished while read */
        seen = g;
        const int tid = h - 1 + first;  /* run(): helpers are tids 1.., start(): tids 0.. */
        left_out = tid >= nth;
        if (!left_out) {
          fn(ctx, tid, nth);
          atomic_fetch_add(&done, 1);
        }
        break;
      }
      PAUSE();
      if (++spins % 256 == 0 && now_ns() - t0 > spin_ns) {
        pthread_mutex_lock(&mu);
        atomic_fetch_add(&sleepers, 1);
        while (atomic_load(&gen) == seen) pthread_cond_wait(&cv, &mu);
        atomic_fetch_sub(&sleepers, 1);
        pthread_mutex_unlock(&mu);
        t0 = now_ns();
      }
    }
  }
  return 0;
}

static void child_after_fork(void) {  /* the child has none of the parent's helpers */
  atomic_store(&helpers, 0); atomic_store(&sleepers, 0); atomic_store(&lock_flag, 0);
  pthread_mutex_init(&mu, 0); pthread_cond_init(&cv, 0);
}

static void ensure_helpers(int n) {
  static int registered;
  if (!registered) { pthread_atfork(0, 0, child_after_fork); registered = 1; }
  if (n > MAX_HELPERS) n = MAX_HELPERS;
  for (int h = atomic_load(&helpers) + 1; h <= n; h++) {
    pthread_t t;
    born[h] = atomic_load(&gen);
    if (pthread_create(&t, 0, helper, (void*)(intptr_t)h)) break;
#ifdef __linux__
    if (n_cpus > h) {
      cpu_set_t set; CPU_ZERO(&set); CPU_SET(cpus[h], &set);
      pthread_setaffinity_np(t, sizeof set, &set);
    }
#endif
    pthread_detach(t);
    atomic_store(&helpers, h);
  }
}

static void acquire(void) {
  while (atomic_exchange(&lock_flag, 1)) sched_yield();
}

static void publish(mp_job fn, void* ctx, int nth, int first) {
  atomic_store(&done, 0);
  atomic_fetch_add(&gen, 1);
  atomic_store(&job_fn, (uintptr_t)fn); atomic_store(&job_ctx, (uintptr_t)ctx);
  atomic_store(&job_nth, nth); atomic_store(&job_first, first);
  atomic_fetch_add(&gen, 1);
  if (atomic_load(&sleepers) > 0) {
    pthread_mutex_lock(&mu); pthread_cond_broadcast(&cv); pthread_mutex_unlock(&mu);
  }
}

static void wait_done(int count) {
  int spins = 0;
  while (atomic_load(&done) < count)
    if (++spins < 1 << 20) PAUSE(); else sched_yield();
}

/* cpu list: helper h pinned to cpus[h] (cpus[0]: the caller's, left alone); spin: microseconds an idle helper
   spins before it sleeps (negative: unchanged). */
void mp_configure(const int* cpu_list, int n, long spin_us) {
  n_cpus = n < MAX_HELPERS + 1 ? n : MAX_HELPERS + 1;
  for (int i = 0; i < n_cpus; i++) cpus[i] = cpu_list[i];
  if (spin_us >= 0) spin_ns = spin_us * 1000L;
}

/* fn(ctx, tid, nth) for every tid < nth, the caller as tid 0; returns when all are done. */
void mp_run(mp_job fn, void* ctx, int nth) {
  if (nth <= 1) { fn(ctx, 0, 1); return; }
  acquire();
  ensure_helpers(nth - 1);
  if (atomic_load(&helpers) < nth - 1) nth = atomic_load(&helpers) + 1;
  publish(fn, ctx, nth, 1);
  fn(ctx, 0, nth);
  wait_done(nth - 1);
  atomic_store(&lock_flag, 0);
}

/* fn(ctx, tid, nth) for every tid < nth on the helpers alone; returns at once, mp_wait() waits. */
void mp_start(mp_job fn, void* ctx, int nth) {
  acquire();
  ensure_helpers(nth);
  if (atomic_load(&helpers) < nth) nth = atomic_load(&helpers);
  if (nth < 1) { fn(ctx, 0, 1); atomic_store(&job_nth, 0); return; }  /* no thread could start: done inline */
  publish(fn, ctx, nth, 0);
}

void mp_wait(void) {
  wait_done(atomic_load(&job_nth));
  atomic_store(&lock_flag, 0);
}

int mp_helpers(void) { return atomic_load(&helpers); }
"""


@functools.cache
def library() -> ctypes.CDLL:
    dll = ctypes.CDLL(str(build.build(SOURCE, "portable")))
    p, i = ctypes.c_void_p, ctypes.c_int
    dll.mp_configure.argtypes = [p, i, ctypes.c_long]
    dll.mp_run.argtypes = [p, p, i]
    dll.mp_start.argtypes = [p, p, i]
    dll.mp_wait.argtypes = []
    dll.mp_helpers.restype = i
    return dll


def entry_points() -> tuple[int, int, int]:
    """Addresses of mp_run, mp_start, mp_wait, for a kernel library's moeserve_set_pool."""
    dll = library()
    return tuple(ctypes.cast(getattr(dll, name), ctypes.c_void_p).value for name in ("mp_run", "mp_start", "mp_wait"))


def configure(cpus: list[int], spin_us: int | None = None) -> None:
    """Pin helper h to cpus[h] (cpus[0] is the calling thread's, not pinned; fewer cpus: the rest unpinned) and let
    idle helpers spin spin_us microseconds before they sleep (None: as before). Applies to helpers started from now
    on (spin: to all)."""
    arr = (ctypes.c_int * max(len(cpus), 1))(*cpus)
    library().mp_configure(arr, len(cpus), -1 if spin_us is None else spin_us)


def helpers() -> int:
    """Helper threads started so far."""
    return library().mp_helpers()
