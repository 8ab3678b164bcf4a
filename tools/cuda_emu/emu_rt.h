// CPU emulator runtime for TVM-generated CUDA kernels (a developer tool in shared/, not part of the project).
// One fiber per CUDA thread (ucontext), exact __syncthreads / warp-collective semantics,
// ldmatrix.x4(.trans) and mma.m16n8k16 per the PTX ISA, a shared-memory race detector
// (barrier epochs), uninitialized-shared-read detector, bounds-checked global pointers,
// divergent-barrier / deadlock detection.
#pragma once
#include <ucontext.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <string>
#include <map>
#include <functional>
#include <algorithm>
#include <stdexcept>

using uchar = unsigned char;
using std::int64_t;

// ---------------- 16-bit float types -------------------------------------------------------
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN
  uint32_t r = u + 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(r >> 16);
}
static inline float bf2f(uint16_t h) { return u2f((uint32_t)h << 16); }
static inline uint16_t f2h(float f) {  // RNE float -> IEEE half
  uint32_t x = f2u(f); uint32_t sign = (x >> 16) & 0x8000; int32_t exp = ((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  if (exp >= 31) return sign | 0x7c00;
  if (exp <= 0) {
    if (exp < -10) return sign;
    mant |= 0x800000; int shift = 14 - exp; uint32_t h = mant >> shift; uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) h++;
    return sign | h;
  }
  uint32_t h = sign | (exp << 10) | (mant >> 13); uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return h;
}
static inline float h2f(uint16_t h) {
  uint32_t sign = (h & 0x8000) << 16; int exp = (h >> 10) & 0x1f; uint32_t mant = h & 0x3ff;
  if (exp == 0) { if (!mant) return u2f(sign); float v = std::ldexp((float)mant, -24); return sign ? -v : v; }
  if (exp == 31) return u2f(sign | 0x7f800000 | (mant << 13));
  return u2f(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}
struct nv_bfloat16 {
  uint16_t x;
  nv_bfloat16() = default;
  nv_bfloat16(float f) : x(f2bf(f)) {}
  nv_bfloat16(double f) : x(f2bf((float)f)) {}
  operator float() const { return bf2f(x); }
};
struct half {
  uint16_t x;
  half() = default;
  half(float f) : x(f2h(f)) {}
  half(double f) : x(f2h((float)f)) {}
  operator float() const { return h2f(x); }
};
struct uint4 { uint32_t x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
static inline float __frcp_rn(float x) { return 1.0f / x; }  // rcp.rn: IEEE-rounded like the host's

// ---------------- errors ----------------------------------------------------------------------
struct EmuStats { long races = 0, uninit = 0, oob = 0, misaligned = 0, deadlock = 0, divergent = 0; };
extern EmuStats g_stats;
extern int g_report_limit;
#define EMU_REPORT(kind, ...) do { g_stats.kind++; if (g_report_limit > 0) { g_report_limit--; fprintf(stderr, "[emu:" #kind "] " __VA_ARGS__); fputc('\n', stderr);} } while (0)

// ---------------- fibers ---------------------------------------------------------------------
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
extern Dim3 threadIdx, blockIdx, blockDim, gridDim;
extern const char* g_kernel_name;

struct Fiber {
  ucontext_t ctx; int tid; bool done = false; std::vector<char> stack;
};
extern std::vector<Fiber*> g_fibers;
extern int g_cur;  // current fiber
extern ucontext_t g_sched_ctx;
extern long g_events;  // progress counter
extern uint64_t g_epoch;  // barrier epoch of the block
extern int g_block_count; extern uint64_t g_block_gen;
extern int g_warp_count[64]; extern uint64_t g_warp_gen[64];

static inline int cur_tid() { return g_fibers[g_cur]->tid; }
static inline void emu_yield() { swapcontext(&g_fibers[g_cur]->ctx, &g_sched_ctx); }

static inline void __syncthreads() {
  int n = (int)g_fibers.size();
  uint64_t gen = g_block_gen; g_block_count++; g_events++;
  if (g_block_count == n) { g_block_count = 0; g_block_gen++; g_epoch++; return; }
  while (g_block_gen == gen) emu_yield();
}
static inline void warp_sync() {
  int w = cur_tid() / 32;
  uint64_t gen = g_warp_gen[w]; g_warp_count[w]++; g_events++;
  if (g_warp_count[w] == 32) { g_warp_count[w] = 0; g_warp_gen[w]++; return; }
  while (g_warp_gen[w] == gen) emu_yield();
}

// __shfl_sync: every lane of the warp deposits its value, then reads its source lane's (two
// warp barriers: a lane that skips the call is reported as a divergent warp / deadlock).
inline float g_shfl_stage[64][32];
static inline unsigned __activemask() { return 0xffffffffu; }
static inline float __shfl_sync(unsigned, float v, int64_t src_lane, int width = 32) {
  int t = cur_tid(), w = t / 32, lane = t % 32;
  g_shfl_stage[w][lane] = v;
  warp_sync();
  float r = g_shfl_stage[w][lane / width * width + (int)(src_lane % width)];
  warp_sync();
  return r;
}

// ---------------- shared memory arena + shadow -------------------------------------------------
struct Shadow { uint64_t w_epoch; int w_tid; uint64_t r_epoch; int r_tid; bool multi; bool init; };
extern std::vector<uint8_t> g_shared;     // arena (dynamic at 0, then statics)
extern std::vector<Shadow> g_shadow;
extern size_t g_dyn_bytes;                // declared dynamic size (bounds for dyn accesses)
extern std::map<std::string, size_t> g_static_off;
extern size_t g_static_end;

static inline void sh_access(const void* p, size_t bytes, bool write, const char* what) {
  const uint8_t* b = (const uint8_t*)p;
  if (b < g_shared.data() || b + bytes > g_shared.data() + g_shared.size()) {
    EMU_REPORT(oob, "%s: shared %s outside arena (off %ld, %zu bytes) tid=%d block=(%u,%u)", g_kernel_name,
               write ? "write" : "read", (long)(b - g_shared.data()), bytes, cur_tid(), blockIdx.x, blockIdx.y);
    return;
  }
  size_t off = b - g_shared.data();
  if (off < g_dyn_bytes && off + bytes > g_dyn_bytes)
    EMU_REPORT(oob, "%s: dyn shared access crosses its end (off %zu + %zu > %zu)", g_kernel_name, off, bytes, g_dyn_bytes);
  int t = cur_tid();
  for (size_t i = 0; i < bytes; ++i) {
    Shadow& s = g_shadow[off + i];
    if (write) {
      if (s.w_epoch == g_epoch && s.w_tid != t)
        EMU_REPORT(races, "%s: WAW on shared byte %zu (%s) tids %d,%d epoch %lu block=(%u,%u)", g_kernel_name, off + i, what, s.w_tid, t, (unsigned long)g_epoch, blockIdx.x, blockIdx.y);
      if (s.r_epoch == g_epoch && (s.r_tid != t || s.multi))
        EMU_REPORT(races, "%s: WAR on shared byte %zu (%s) reader %d writer %d epoch %lu block=(%u,%u)", g_kernel_name, off + i, what, s.r_tid, t, (unsigned long)g_epoch, blockIdx.x, blockIdx.y);
      s.w_epoch = g_epoch; s.w_tid = t; s.init = true;
    } else {
      if (!s.init)
        EMU_REPORT(uninit, "%s: read of never-written shared byte %zu (%s) tid %d block=(%u,%u)", g_kernel_name, off + i, what, t, blockIdx.x, blockIdx.y);
      if (s.w_epoch == g_epoch && s.w_tid != t)
        EMU_REPORT(races, "%s: RAW on shared byte %zu (%s) writer %d reader %d epoch %lu block=(%u,%u)", g_kernel_name, off + i, what, s.w_tid, t, (unsigned long)g_epoch, blockIdx.x, blockIdx.y);
      if (s.r_epoch != g_epoch) { s.r_epoch = g_epoch; s.r_tid = t; s.multi = false; }
      else if (s.r_tid != t) s.multi = true;
    }
  }
}

template <typename T> struct ShRef {
  T* p;
  operator T() const { sh_access(p, sizeof(T), false, "elem"); T v; memcpy(&v, p, sizeof(T)); return v; }
  ShRef& operator=(T v) { sh_access(p, sizeof(T), true, "elem"); memcpy(p, &v, sizeof(T)); return *this; }
  ShRef& operator=(const ShRef& o) { return *this = (T)o; }
  T* operator&() const { return p; }
};
template <typename T> struct ShPtr {
  T* p;
  ShRef<T> operator[](int64_t i) const { return ShRef<T>{p + i}; }
  ShPtr operator+(int64_t i) const { return ShPtr{p + i}; }
};
template <typename T> static inline ShPtr<T> shp(void* base) { return ShPtr<T>{(T*)base}; }
// 16-byte vector store into shared memory
template <typename V> static inline V& sh_vec_w(void* p) {
  if (((uintptr_t)p) % sizeof(V)) EMU_REPORT(misaligned, "%s: misaligned shared vector store", g_kernel_name);
  sh_access(p, sizeof(V), true, "vec16");
  return *(V*)p;
}
extern uint8_t* g_dyn_base;
static inline void* emu_static_shared(const char* name, size_t bytes) {
  auto it = g_static_off.find(name);
  if (it != g_static_off.end()) return g_shared.data() + it->second;
  size_t off = (g_static_end + 127) / 128 * 128;
  g_static_off[name] = off; g_static_end = off + bytes;
  if (g_static_end > g_shared.size()) { fprintf(stderr, "arena too small\n"); abort(); }
  return g_shared.data() + off;
}

// ---------------- global memory (bounds-checked) ---------------------------------------------
template <typename T> struct GPtr {
  T* base; int64_t n; int64_t off; const char* name;
  T& operator[](int64_t i) const {
    int64_t j = off + i;
    if (j < 0 || j >= n) { EMU_REPORT(oob, "%s: global %s[%ld] out of [0,%ld) tid=%d block=(%u,%u)", g_kernel_name, name, (long)j, (long)n, cur_tid(), blockIdx.x, blockIdx.y); static T dummy; return dummy; }
    return base[j];
  }
  GPtr operator+(int64_t i) const { return GPtr{base, n, off + i, name}; }
  template <typename U> explicit operator U*() const {
    int64_t bytes_off = off * (int64_t)sizeof(T);
    if (off < 0 || bytes_off + (int64_t)sizeof(U) > n * (int64_t)sizeof(T)) {
      EMU_REPORT(oob, "%s: global vector access %s[%ld..+%zuB] out of %ld elems tid=%d block=(%u,%u)", g_kernel_name, name, (long)off, sizeof(U), (long)n, cur_tid(), blockIdx.x, blockIdx.y);
      static U dummy; return &dummy;
    }
    if (((uintptr_t)(base + off)) % sizeof(U)) EMU_REPORT(misaligned, "%s: misaligned %zu-byte global access %s[%ld]", g_kernel_name, sizeof(U), name, (long)off);
    return (U*)(base + off);
  }
};
template <typename T> GPtr<T> gptr(T* p, int64_t n, const char* name) { return GPtr<T>{p, n, 0, name}; }

// ---------------- math -----------------------------------------------------------------------
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline float min(float a, float b) { return fminf(a, b); }
static inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
#define CUDART_INF_F INFINITY
static inline float atomicAdd(float* p, float v) { float o = *p; *p = o + v; return o; }  // fibers: no preemption

// ---------------- warp collectives -----------------------------------------------------------
struct WarpStage {
  uintptr_t addr[32];
  uint32_t a[32][4], b[32][2]; float c[32][4];
};
extern WarpStage g_stage[64];

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16
static inline void emu_ldmatrix(bool trans, uintptr_t addr, uint32_t* r) {
  int t = cur_tid(), w = t / 32, lane = t % 32;
  if (addr % 16) EMU_REPORT(misaligned, "%s: ldmatrix row address not 16-byte aligned", g_kernel_name);
  sh_access((const void*)addr, 16, false, trans ? "ldmatrix.trans" : "ldmatrix");
  g_stage[w].addr[lane] = addr;
  warp_sync();
  for (int i = 0; i < 4; ++i) {
    uint16_t v[2];
    for (int j = 0; j < 2; ++j) {
      int row, col;
      if (!trans) { row = lane / 4; col = 2 * (lane % 4) + j; }
      else { row = 2 * (lane % 4) + j; col = lane / 4; }
      const uint16_t* rp = (const uint16_t*)g_stage[w].addr[8 * i + row];
      v[j] = rp[col];
    }
    r[i] = (uint32_t)v[0] | ((uint32_t)v[1] << 16);
  }
  warp_sync();
}

template <bool BF16> static inline float cvt16(uint16_t h) { return BF16 ? bf2f(h) : h2f(h); }
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32
template <bool BF16>
static inline void emu_mma(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  int t = cur_tid(), w = t / 32, lane = t % 32;
  memcpy(g_stage[w].a[lane], a, 16); memcpy(g_stage[w].b[lane], b, 8); memcpy(g_stage[w].c[lane], c, 16);
  warp_sync();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    int g = l / 4, q = l % 4;
    const uint32_t* ar = g_stage[w].a[l];
    auto lo = [](uint32_t x) { return (uint16_t)(x & 0xffff); };
    auto hi = [](uint32_t x) { return (uint16_t)(x >> 16); };
    A[g][2*q] = cvt16<BF16>(lo(ar[0])); A[g][2*q+1] = cvt16<BF16>(hi(ar[0]));
    A[g+8][2*q] = cvt16<BF16>(lo(ar[1])); A[g+8][2*q+1] = cvt16<BF16>(hi(ar[1]));
    A[g][2*q+8] = cvt16<BF16>(lo(ar[2])); A[g][2*q+9] = cvt16<BF16>(hi(ar[2]));
    A[g+8][2*q+8] = cvt16<BF16>(lo(ar[3])); A[g+8][2*q+9] = cvt16<BF16>(hi(ar[3]));
    const uint32_t* br = g_stage[w].b[l];
    B[2*q][g] = cvt16<BF16>(lo(br[0])); B[2*q+1][g] = cvt16<BF16>(hi(br[0]));
    B[2*q+8][g] = cvt16<BF16>(lo(br[1])); B[2*q+9][g] = cvt16<BF16>(hi(br[1]));
  }
  int g = lane / 4, q = lane % 4;
  int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2*q, 2*q+1, 2*q, 2*q+1};
  float out[4];
  for (int i = 0; i < 4; ++i) {
    float acc = g_stage[w].c[lane][i];
    for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
    out[i] = acc;
  }
  warp_sync();
  memcpy(d, out, 16);
}

// ---------------- launcher -------------------------------------------------------------------
void emu_launch(const char* name, Dim3 grid, Dim3 block, size_t dyn_bytes, std::function<void()> body);
