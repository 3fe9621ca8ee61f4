// A tensor-parallel group's channel between the ranks (processes) of one host, over one shared
// memory segment that Python creates and maps (workers/kernels/tp_comm.py) and passes in as
// `base`: all-reduce (sum, float32 or bf16), broadcast from rank 0, gather to rank 0, barrier.
// The models are vLLM-CPU's csrc/cpu/shm.cpp and DeepSpeed's CPU shm all-reduce: per-rank
// sequence flags in the segment, ranks spin on them, no lock.
//
// Layout (every area 4 KiB-aligned, W ranks, S slot bytes, B broadcast bytes):
//   Header: Meta (magic, W, S, B, abort flag), W Flags (seq, pid: one 128-byte line each: the
//           owner writes, the peers spin on it), W Privs (the owner's call counter and the seq
//           it had at its last call's start: read by its owner only)
//   broadcast areas [2] of (64-byte length line + B)
//   slots [W][2] of S: each rank's input, double-buffered by call parity
//   results [2] of S: the reduce-scatter's sums
//
// Protocol. Every rank makes the same calls in the same order (a collective), so every rank's
// seq, bumped once per stage of a call (release), holds the same values at the same points of
// the call sequence: "peer p reached stage s of this call" is flags[p].seq >= s (acquire).
// Call c uses the buffers of parity c & 1. Its guard, before it writes any buffer: every peer
// has published a stage of call c - 1, so each finished reading call c - 2's buffers (a rank
// reads only between its own stages or after its last one, never after its next call's first
// publish). No flag is ever reset, so back-to-back calls never race.
//   all-reduce, all-read (1 stage; the one for 2 ranks): copy in, publish, wait all, each rank
//     sums every slot (its own term from its tensor) into its tensor.
//   all-reduce, reduce-scatter (2 stages; more ranks, larger messages): copy in, publish, wait
//     all, rank r sums its 1/W of every slot into results, publish, wait all, copy results out.
//   broadcast (1 stage): rank 0 writes its area, publishes; the others wait for it, copy out,
//     publish. gather (1 stage): all copy in, publish; rank 0 waits for all, copies out.
//   barrier (1 stage): publish, wait all.
// Messages larger than a slot go in slot-sized calls.
//
// Numerics: element i's sum is slot 0 + slot 1 + ... + slot W-1 in rank order in float32 (each
// add kept in order by an empty asm that hides the partial sum from -ffast-math's
// reassociation), bf16 widened exactly, summed in float32, rounded once to nearest even. Vector
// and scalar code do the same per-element operations, so every rank gets the same bits, for the
// same inputs, whatever the timing.
//
// Waiting: spin with pause, then sched_yield, then sleep on a futex (the seq word's low 32 bits:
// a rank that publishes wakes its sleepers, so an idle broadcast follower wakes at once and
// costs no CPU while the worker is idle); fewer spins when the ranks outnumber the CPUs. Every
// wait has a timeout (negative: none), checks the abort flag, and checks the waited-for peer's
// liveness (kill(pid, 0) and not a zombie) every 2 ms (20 ms after 100 ms). A failed wait sets
// the abort flag (the group is broken: the ranks' sequences no longer agree), wakes the
// sleepers and returns an error code: -1 timeout, -2 aborted, -4 bad arguments, -(100 + r):
// rank r died.
//
// Measured (2 ranks, float32, median per call, AMD EPYC 2 vCPUs, tp_comm.measure_allreduce_us):
// 4 KiB 2.9 us, 36 KiB 6.0 us, 144 KiB 12.1 us, 2 MiB 169 us (gloo: 814, 773, 737, 2,995 us).
// The all-read is the 2-rank algorithm; with more ranks the reduce-scatter takes messages over
// 64 KiB (a guess: this 2-core machine cannot time 3+ ranks; algo picks either one to compare).
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>

namespace {

constexpr uint64_t MAGIC = 0x7261797064747031ULL;  // "raypdtp1"
constexpr int MAX_RANKS = 16;
constexpr int64_t ALIGN = 4096;
constexpr int OK = 0, TIMEOUT = -1, ABORTED = -2, BADARG = -4, DEAD = -100;
constexpr int F32 = 0, BF16 = 1;
constexpr int ALGO_AUTO = 0, ALGO_ALL_READ = 1, ALGO_REDUCE_SCATTER = 2;

struct alignas(128) Meta {
  uint64_t magic;
  int64_t world, slot_bytes, bcast_bytes;
  std::atomic<int> abort;
};
struct alignas(128) Flag {
  std::atomic<uint64_t> seq;     // its low 32 bits are the futex word sleepers wait on
  std::atomic<int64_t> pid;
  std::atomic<int> sleepers;     // ranks asleep on seq: the owner wakes them when it publishes
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// sleeps while the 32-bit word at `addr` holds `val`, at most `ns` (shared, not private: the
// word is in a mapping other processes share); wakes every sleeper on it
inline void futex_wait(void* addr, uint32_t val, int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, nullptr, 0);
}
inline void futex_wake(void* addr) {
  syscall(SYS_futex, addr, FUTEX_WAKE, 1 << 30, nullptr, nullptr, 0);
}
struct alignas(128) Priv {
  uint64_t calls;       // calls made (parity: which buffers)
  uint64_t last_start;  // this rank's seq when its last call began
};
struct Header {
  Meta meta;
  Flag flags[MAX_RANKS];
  Priv privs[MAX_RANKS];
};

inline int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// offsets of the areas
struct Layout {
  int64_t world, slot, bcast, bcast_off, bcast_stride, slots_off, results_off, total;
  Layout(int64_t w, int64_t s, int64_t b) : world(w), slot(align_up(s, ALIGN)), bcast(b) {
    bcast_off = align_up(sizeof(Header), ALIGN);
    bcast_stride = align_up(64 + b, ALIGN);
    slots_off = bcast_off + 2 * bcast_stride;
    results_off = slots_off + w * 2 * slot;
    total = results_off + 2 * slot;
  }
};

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int cpus() {
  static const int n = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    return c > 0 ? static_cast<int>(c) : 1;
  }();
  return n;
}

// whether process `pid` has ended (gone, or a zombie not yet reaped by its parent)
bool dead(int64_t pid) {
  if (pid <= 0) return false;  // not registered yet: only the timeout applies
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64], buf[512];
  snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = fopen(path, "r");
  if (f == nullptr) return false;
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* p = strrchr(buf, ')');
  return p != nullptr && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

// sets the abort flag and wakes every sleeping rank
void abort_group(Header* h) {
  h->meta.abort.store(1, std::memory_order_seq_cst);
  for (int r = 0; r < h->meta.world; ++r) futex_wake(&h->flags[r].seq);
}

// one call's view of the segment
struct Comm {
  Header* h;
  char* base;
  Layout lay;
  int rank, world;
  Priv* me;
  uint64_t seq;        // this rank's seq (only it writes it)
  int64_t deadline;    // ns, or -1: none
  int par;

  Comm(void* b, int r, double timeout_s)
      : h(static_cast<Header*>(b)), base(static_cast<char*>(b)),
        lay(h->meta.world, h->meta.slot_bytes, h->meta.bcast_bytes), rank(r),
        world(static_cast<int>(h->meta.world)), me(&h->privs[r]),
        seq(h->flags[r].seq.load(std::memory_order_relaxed)),
        deadline(timeout_s < 0 ? -1 : now_ns() + static_cast<int64_t>(timeout_s * 1e9)),
        par(0) {}

  char* slot(int r, int p) const { return base + lay.slots_off + (r * 2 + p) * lay.slot; }
  char* result(int p) const { return base + lay.results_off + p * lay.slot; }
  char* bcast_area(int p) const { return base + lay.bcast_off + p * lay.bcast_stride + 64; }
  int64_t* bcast_len(int p) const {
    return reinterpret_cast<int64_t*>(base + lay.bcast_off + p * lay.bcast_stride);
  }

  int fail(int code) {
    abort_group(h);
    return code;
  }

  // wait until rank p's seq >= target
  int wait(int p, uint64_t target, bool idle) {
    const std::atomic<uint64_t>& f = h->flags[p].seq;
    if (f.load(std::memory_order_acquire) >= target) return OK;
    const bool crowded = world > cpus();
    const int64_t spin_ns = crowded ? 2000 : idle ? 30000 : 300000;
    const int64_t yield_ns = crowded ? 2000000 : idle ? 30000 : 2000000;
    const int64_t t0 = now_ns();
    int64_t next_check = t0 + 2000000;
    bool spinning = true;
    for (uint32_t i = 1;; ++i) {
      if (f.load(std::memory_order_acquire) >= target) return OK;
      if (spinning && (i & 31) != 0) {  // the clock is read every 32 pauses while spinning
        cpu_pause();
        continue;
      }
      const int64_t now = now_ns();
      if (h->meta.abort.load(std::memory_order_acquire)) return ABORTED;
      if (deadline >= 0 && now > deadline) return fail(TIMEOUT);
      const int64_t waited = now - t0;
      // liveness checks (a kill and a /proc read) every 2 ms, every 20 ms after 100 ms idle
      const int64_t every = waited < 100000000 ? 2000000 : 20000000;
      if (now >= next_check) {
        if (dead(h->flags[p].pid.load(std::memory_order_relaxed))) return fail(DEAD - p);
        next_check = now + every;
      }
      if (waited < spin_ns) continue;
      spinning = false;  // past the spin budget: one backoff step between checks
      if (waited < yield_ns) {
        sched_yield();
      } else {
        // asleep until p publishes (it wakes its sleepers), abort() wakes us, or the next
        // liveness check is due. Dekker: we count ourselves then read seq, p stores seq
        // then reads the count (both seq_cst): p sees us, or we see its new seq
        Flag& fp = h->flags[p];
        fp.sleepers.fetch_add(1, std::memory_order_seq_cst);
        const uint64_t cur = f.load(std::memory_order_seq_cst);
        if (cur < target) futex_wait(&fp.seq, static_cast<uint32_t>(cur), every);
        fp.sleepers.fetch_sub(1, std::memory_order_relaxed);
      }
    }
  }

  int wait_all(uint64_t target, bool idle = false) {
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      const int rc = wait(p, target, idle);
      if (rc != OK) return rc;
    }
    return OK;
  }

  // start a call: its parity, and the guard (every peer published a stage of the last call)
  int begin() {
    if (h->meta.abort.load(std::memory_order_acquire)) return ABORTED;
    par = static_cast<int>(me->calls & 1);
    const uint64_t guard = me->calls ? me->last_start + 1 : 0;
    me->last_start = seq;
    me->calls++;
    return guard ? wait_all(guard) : OK;
  }

  void publish() {
    Flag& f = h->flags[rank];
    f.seq.store(++seq, std::memory_order_seq_cst);
    if (f.sleepers.load(std::memory_order_seq_cst) > 0) futex_wake(&f.seq);
  }
};

// keeps a partial sum in order: -ffast-math may not reassociate across it
#if defined(__x86_64__) || defined(__i386__)
#define RAYPD_KEEP(v) asm("" : "+x"(v))
#elif defined(__aarch64__)
#define RAYPD_KEEP(v) asm("" : "+w"(v))
#else
#define RAYPD_KEEP(v) asm("" : "+m"(v))
#endif

inline float bf16_f(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f_bf16(float f) {  // nearest even; NaN -> 0x7FC0 (bit tests: -ffast-math)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
}

// out[i] = src[0][i] + src[1][i] + ... + src[w-1][i] (float32, in order), i in [0, n)
void sum_f32(float* out, const float* const* src, int w, int64_t n) {
  int64_t i = 0;
#ifdef __AVX__
  for (; i + 32 <= n; i += 32) {
    __m256 a0 = _mm256_loadu_ps(src[0] + i), a1 = _mm256_loadu_ps(src[0] + i + 8);
    __m256 a2 = _mm256_loadu_ps(src[0] + i + 16), a3 = _mm256_loadu_ps(src[0] + i + 24);
    for (int r = 1; r < w; ++r) {
      const float* s = src[r] + i;
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(s));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(s + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(s + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(s + 24));
      RAYPD_KEEP(a0);
      RAYPD_KEEP(a1);
      RAYPD_KEEP(a2);
      RAYPD_KEEP(a3);
    }
    _mm256_storeu_ps(out + i, a0);
    _mm256_storeu_ps(out + i + 8, a1);
    _mm256_storeu_ps(out + i + 16, a2);
    _mm256_storeu_ps(out + i + 24, a3);
  }
#endif
  for (; i < n; ++i) {
    float a = src[0][i];
    for (int r = 1; r < w; ++r) {
      a = a + src[r][i];
      RAYPD_KEEP(a);
    }
    out[i] = a;
  }
}

#ifdef __AVX2__
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline void store_bf16x8(uint16_t* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  __m256i r = _mm256_add_epi32(
      u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                          _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// the bf16 sum: widened, summed in float32 in rank order, rounded once
void sum_bf16(uint16_t* out, const uint16_t* const* src, int w, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 16 <= n; i += 16) {
    __m256 a0 = bf16x8(src[0] + i), a1 = bf16x8(src[0] + i + 8);
    for (int r = 1; r < w; ++r) {
      a0 = _mm256_add_ps(a0, bf16x8(src[r] + i));
      a1 = _mm256_add_ps(a1, bf16x8(src[r] + i + 8));
      RAYPD_KEEP(a0);
      RAYPD_KEEP(a1);
    }
    store_bf16x8(out + i, a0);
    store_bf16x8(out + i + 8, a1);
  }
#endif
  for (; i < n; ++i) {
    float a = bf16_f(src[0][i]);
    for (int r = 1; r < w; ++r) {
      a = a + bf16_f(src[r][i]);
      RAYPD_KEEP(a);
    }
    out[i] = f_bf16(a);
  }
}

void sum(int dtype, void* out, const void* const* src, int w, int64_t n) {
  if (dtype == F32)
    sum_f32(static_cast<float*>(out), reinterpret_cast<const float* const*>(src), w, n);
  else
    sum_bf16(static_cast<uint16_t*>(out), reinterpret_cast<const uint16_t* const*>(src), w, n);
}

}  // namespace

extern "C" {

// the segment's size for `world` ranks, slots of `slot_bytes`, a broadcast area of
// `bcast_bytes` (-4: out of range)
int64_t raypd_shm_comm_bytes(int world, int64_t slot_bytes, int64_t bcast_bytes) {
  if (world < 1 || world > MAX_RANKS || slot_bytes < 64 || slot_bytes % 64 || bcast_bytes < 64)
    return BADARG;
  return Layout(world, slot_bytes, bcast_bytes).total;
}

// rank 0 writes the header of a new, zeroed segment (before any other rank can open it)
int raypd_shm_comm_init(void* base, int world, int64_t slot_bytes, int64_t bcast_bytes) {
  if (raypd_shm_comm_bytes(world, slot_bytes, bcast_bytes) < 0) return BADARG;
  Header* h = static_cast<Header*>(base);
  h->meta.world = world;
  h->meta.slot_bytes = slot_bytes;
  h->meta.bcast_bytes = bcast_bytes;
  h->meta.abort.store(0);
  std::atomic_thread_fence(std::memory_order_release);
  h->meta.magic = MAGIC;
  return OK;
}

// `rank` joins: checks the header against world and slot_bytes (-4 when they differ or rank
// is out of range) and registers this process's pid for the peers' liveness checks
int raypd_shm_comm_join(void* base, int rank, int world, int64_t slot_bytes) {
  Header* h = static_cast<Header*>(base);
  if (h->meta.magic != MAGIC || h->meta.world != world || h->meta.slot_bytes != slot_bytes ||
      rank < 0 || rank >= world)
    return BADARG;
  h->flags[rank].pid.store(getpid(), std::memory_order_release);
  return OK;
}

// the broadcast area's bytes (from the header)
int64_t raypd_shm_comm_bcast_bytes(void* base) {
  return static_cast<Header*>(base)->meta.bcast_bytes;
}

// sets the abort flag: every rank waiting in (or entering) a call returns -2
void raypd_shm_comm_abort(void* base) { abort_group(static_cast<Header*>(base)); }

// data [n] (dtype 0: float32, 1: bf16) = the sum of every rank's data, in place; algo 0: the
// all-read for 2 ranks and small messages, reduce-scatter otherwise, 1 / 2: that one. 0 or an
// error code
int raypd_shm_all_reduce(void* base, int rank, void* data, int64_t n, int dtype, int algo,
                         double timeout_s) {
  if (dtype != F32 && dtype != BF16) return BADARG;
  Comm c(base, rank, timeout_s);
  const int64_t es = dtype == F32 ? 4 : 2;
  const int64_t chunk = c.lay.slot / es;
  const void* src[MAX_RANKS];
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t m = n - off < chunk ? n - off : chunk;
    char* mine = static_cast<char*>(data) + off * es;
    const bool all_read = algo == ALGO_ALL_READ ||
                          (algo == ALGO_AUTO && (c.world <= 2 || m * es <= (64 << 10)));
    int rc = c.begin();
    if (rc != OK) return rc;
    std::memcpy(c.slot(rank, c.par), mine, m * es);
    c.publish();
    if ((rc = c.wait_all(c.seq)) != OK) return rc;
    for (int r = 0; r < c.world; ++r) src[r] = r == rank ? mine : c.slot(r, c.par);
    if (all_read || c.world == 1) {
      sum(dtype, mine, src, c.world, m);
      continue;
    }
    // this rank's part: [lo, hi), whole 64-byte lines
    const int64_t line = 64 / es;
    const int64_t per = (m + c.world - 1) / c.world;
    const int64_t part = (per + line - 1) / line * line;
    const int64_t lo = rank * part < m ? rank * part : m;
    const int64_t hi = lo + part < m ? lo + part : m;
    for (int r = 0; r < c.world; ++r) src[r] = c.slot(r, c.par) + lo * es;
    sum(dtype, c.result(c.par) + lo * es, src, c.world, hi - lo);
    c.publish();
    if ((rc = c.wait_all(c.seq)) != OK) return rc;
    std::memcpy(mine, c.result(c.par), m * es);
  }
  return OK;
}

// rank 0: sends buf [nbytes] (at most the broadcast area's bytes); the others: receive into
// buf (room for nbytes). The bytes sent, or an error code. An idle receiver backs off to sleep.
int64_t raypd_shm_broadcast(void* base, int rank, void* buf, int64_t nbytes, double timeout_s) {
  Comm c(base, rank, timeout_s);
  if (rank == 0 && nbytes > c.lay.bcast) return BADARG;
  int rc = c.begin();
  if (rc != OK) return rc;
  if (rank == 0) {
    *c.bcast_len(c.par) = nbytes;
    std::memcpy(c.bcast_area(c.par), buf, nbytes);
    c.publish();
    return nbytes;
  }
  if ((rc = c.wait(0, c.seq + 1, true)) != OK) return rc;
  const int64_t len = *c.bcast_len(c.par);
  if (len > nbytes) return c.fail(BADARG);
  std::memcpy(buf, c.bcast_area(c.par), len);
  c.publish();
  return len;
}

// every rank's src [nbytes] to rank 0's dst [world][nbytes] (in rank order); 0 or an error code
int raypd_shm_gather(void* base, int rank, const void* src, int64_t nbytes, void* dst,
                     double timeout_s) {
  Comm c(base, rank, timeout_s);
  for (int64_t off = 0; off < nbytes; off += c.lay.slot) {
    const int64_t m = nbytes - off < c.lay.slot ? nbytes - off : c.lay.slot;
    int rc = c.begin();
    if (rc != OK) return rc;
    if (rank != 0) {
      std::memcpy(c.slot(rank, c.par), static_cast<const char*>(src) + off, m);
      c.publish();
    } else {
      std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, m);
      c.publish();
      if ((rc = c.wait_all(c.seq)) != OK) return rc;
      for (int r = 1; r < c.world; ++r)
        std::memcpy(static_cast<char*>(dst) + r * nbytes + off, c.slot(r, c.par), m);
    }
  }
  return OK;
}

// returns when every rank has called it (0) or an error code
int raypd_shm_barrier(void* base, int rank, double timeout_s) {
  Comm c(base, rank, timeout_s);
  int rc = c.begin();
  if (rc != OK) return rc;
  c.publish();
  return c.wait_all(c.seq);
}

}  // extern "C"
