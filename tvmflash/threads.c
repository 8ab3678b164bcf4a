/* TVM's parallel launch on torch's OpenMP threads (tvmflash/threads.py compiles and loads this).
 *
 * TVM's LLVM code calls its parallel loops through a function pointer in each library
 * (__TVMBackendParallelLaunch). threads.py points it at tvmflash_parallel_launch, which runs
 * the tasks as one GNU OpenMP parallel region of the libgomp torch uses: the same worker
 * threads as torch's intra-op pool, as many as omp_get_max_threads() (torch.set_num_threads).
 * The libgomp entry points are passed in by threads.py (looked up through libtorch_cpu).
 * A kernel whose region has several stages (TVM's parallel launch point) separates them with
 * TVMBackendParallelBarrier: tvmflash_parallel_barrier, a barrier of the team.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
  void* sync_handle;
  int32_t num_task;
} ParallelGroupEnv; /* TVMParallelGroupEnv */

typedef int (*ParallelLambda)(int task_id, ParallelGroupEnv* penv, void* cdata);

static void (*gomp_parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
static void (*gomp_barrier)(void);
static int (*omp_get_thread_num)(void);
static int (*omp_get_num_threads)(void);
static int (*omp_get_max_threads)(void);
static int (*omp_in_parallel)(void);

/* GNU libgomp's pool does not survive fork: a parallel region in the child waits forever for
 * the parent's workers. A forked child runs the tasks on its calling thread. */
static volatile int forked_child = 0;
static __thread long own_tid = 0; /* this thread's id (gettid is a system call: once per thread) */
static void on_fork_child(void) {
  forked_child = 1;
  own_tid = 0; /* (the forking thread, the child's only one, has a new id) */
}
/* Whether this process started a libgomp region (then libgomp's pool exists and a forked child
 * must not start one: threads.py makes torch's own ops in the child single-threaded too). */
static volatile int started_region = 0;
int tvmflash_threads_started_region(void) { return started_region; }

/* What the last launch ran on (read by the tests): team size and the OS thread of each task. */
#define MAX_RECORDED 256
static volatile int last_team = 0;
static volatile long last_tids[MAX_RECORDED];
static long launches = 0;

typedef struct {
  ParallelLambda lambda;
  void* cdata;
  volatile int failed;
} Job;

static void run_task(Job* job, int task_id, int num_task) {
  ParallelGroupEnv env = {0, num_task};
  if (own_tid == 0) own_tid = (long)syscall(SYS_gettid);
  if (task_id < MAX_RECORDED) last_tids[task_id] = own_tid;
  if (job->lambda(task_id, &env, job->cdata) != 0) job->failed = 1;
}

static void run_in_team(void* data) {
  run_task((Job*)data, omp_get_thread_num(), omp_get_num_threads());
}

/* At most this many threads for this calling thread's launches (0: no limit): tvmflash sets it
 * before each call from the work's size, so a call with one task wakes no worker. */
static __thread int team_limit = 0;
void tvmflash_threads_limit(int limit) { team_limit = limit; }

int tvmflash_parallel_launch(ParallelLambda lambda, void* cdata, int num_task) {
  Job job = {lambda, cdata, 0};
  int team = omp_get_max_threads();
  if (num_task > 0 && num_task < team) team = num_task;
  if (team_limit > 0 && team_limit < team) team = team_limit;
  __atomic_fetch_add(&launches, 1, __ATOMIC_RELAXED);
  if (team <= 1 || forked_child || omp_in_parallel()) {
    last_team = 1;
    run_task(&job, 0, 1);
  } else {
    started_region = 1;
    gomp_parallel(run_in_team, &job, (unsigned)team, 0);
    last_team = team; /* the team libgomp gave (it may give fewer threads than asked) */
  }
  return job.failed ? -1 : 0;
}

/* TVMBackendParallelBarrier: every task of the launch reaches it before any goes on. A launch
 * run inline (one task: a single team, a forked child, inside another parallel region) has no
 * one to wait for; with GOMP_barrier there it would wait for the enclosing region's team. */
int tvmflash_parallel_barrier(int task_id, ParallelGroupEnv* penv) {
  (void)task_id;
  if (penv->num_task > 1) gomp_barrier();
  return 0;
}

void tvmflash_threads_init(void* parallel, void* barrier, void* thread_num, void* num_threads,
                           void* max_threads, void* in_parallel) {
  static int registered = 0;
  gomp_parallel = parallel;
  gomp_barrier = barrier;
  omp_get_thread_num = thread_num;
  omp_get_num_threads = num_threads;
  omp_get_max_threads = max_threads;
  omp_in_parallel = in_parallel;
  if (!registered) {
    pthread_atfork(0, 0, on_fork_child);
    registered = 1;
  }
}

/* Test hooks: the team of the last launch, its task threads, the number of launches. */
int tvmflash_threads_last(long* tids, int capacity, long* count) {
  int team = last_team;
  for (int i = 0; i < team && i < capacity && i < MAX_RECORDED; i++) tids[i] = last_tids[i];
  *count = __atomic_load_n(&launches, __ATOMIC_RELAXED);
  return team;
}

int tvmflash_threads_forked(void) { return forked_child; }
