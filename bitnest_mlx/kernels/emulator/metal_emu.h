// CPU emulator for Metal compute kernels: Metal types and builtins for g++, and a fiber scheduler
// that runs one fiber per GPU thread with real simdgroup (32 lanes) and threadgroup semantics.
//
// Layout of a translation unit (see emulator.py):
//   #include "metal_emu.h"          this file: runtime, no address-space macros yet
//   #include "metal_emu_begin.h"    macros for Metal's address spaces (`thread` would clash with std)
//   <header> <the exact source MLX generates> <generated launcher>
//   #include "metal_emu_end.h"      #undef them again
//
// Scheduling: the threadgroups of a grid run one after another; inside a threadgroup every GPU
// thread is a ucontext fiber, resumed round-robin. A fiber yields only at a simdgroup operation or
// a barrier, where it waits until every live thread of its simdgroup (or threadgroup) arrived at the
// same call site. `threadgroup` variables become function statics, shared by all fibers of the
// running threadgroup (threadgroups never overlap in time, so this is exact).
// Checked, because Metal leaves them undefined: a barrier that not every thread reaches, and
// lanes that meet at different simd/barrier call sites (divergent control flow).
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

// The simd and barrier builtins stay calls in every build: a counting build (EMU_COUNT, see
// counting.py) counts the calls and must not count the scheduler's own work inside them.
#define EMU_RUNTIME __attribute__((noinline))

#if defined(EMU_COUNT) && !defined(__FLT16_MAX__)
// Counting builds use clang, which has no x86 _Float16 before clang 15: __fp16 is the same IEEE
// binary16 storage, converted by the two helpers below (the only code they need at run time).
typedef __fp16 half;
typedef __fp16 float16_t;
#else
typedef _Float16 half;
typedef _Float16 float16_t;
#endif
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

// bfloat16: storage is the top 16 bits of a float32; conversion rounds to nearest even.
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

struct uint3 {
  uint x, y, z;
};
struct uint2 {
  uint x, y;
};

#if defined(EMU_COUNT)
// Executions of each instrumented basic block (counting.py inserts the calls into the IR).
inline std::vector<uint64_t> g_block_counts;
extern "C" EMU_RUNTIME void emu_count_block(int id) {
  if (size_t(id) >= g_block_counts.size()) g_block_counts.resize(size_t(id) + 1);
  g_block_counts[size_t(id)]++;
}
extern "C" int emu_read_counts(uint64_t* out, int n) {
  int have = int(g_block_counts.size());
  for (int i = 0; i < n; i++) out[i] = i < have ? g_block_counts[size_t(i)] : 0;
  g_block_counts.assign(g_block_counts.size(), 0);
  return have;
}
#if !defined(__FLT16_MAX__)
extern "C" float __gnu_h2f_ieee(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  float v;
  if (e == 0) v = std::ldexp(float(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(float(m | 0x400u), int(e) - 25);
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u |= sign;
  std::memcpy(&v, &u, 4);
  return v;
}
extern "C" uint16_t __gnu_f2h_ieee(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(a)) return sign | 0x7e00u;
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds past the largest half: infinity
  if (a < 6.103515625e-05f) {  // subnormal half: multiples of 2^-24, ties to even by rint
    return sign | uint16_t(std::nearbyint(a * 16777216.0f));
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  const float q = std::nearbyint(std::ldexp(m, 11));  // 11 significant bits
  uint32_t mant = uint32_t(q), exp = uint32_t(e + 14);
  if (mant == 2048u) mant = 1024u, exp++;
  return sign | uint16_t(exp << 10 | (mant & 0x3ffu));
}
#endif
#endif

namespace emu {

constexpr int kSimdWidth = 32;

struct Barrier {
  int expected = 0;  // live members
  int arrived = 0;
  uint64_t generation = 0;
  int line = -1;  // call site of the first arrival in this generation
};

struct SimdGroup {
  Barrier bar;
  alignas(16) unsigned char slot[kSimdWidth][16];
  bool present[kSimdWidth];
};

struct Fiber {
  ucontext_t ctx;
  bool done = false;
  uint lane = 0, sg = 0;
};

struct Thread {
  uint3 tpig, tpitg, tgpig, tg_size;
  uint index_in_tg;
};

struct Sched {
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  std::vector<SimdGroup> sgs;
  Barrier tg_bar;
  ucontext_t main;
  int current = 0;
  uint64_t progress = 0;  // bumped whenever a wait can end: a completed barrier or a finished fiber
  const char* error = nullptr;
  int error_line = -1;
  std::function<void(const Thread&)> body;
  std::vector<Thread> info;
};

inline Sched* g_sched = nullptr;
constexpr size_t kStack = 256 * 1024;

inline Fiber& me() { return g_sched->fibers[g_sched->current]; }

inline void yield() { swapcontext(&me().ctx, &g_sched->main); }

inline void fail(const char* what, int line) {
  if (!g_sched->error) {
    g_sched->error = what;
    g_sched->error_line = line;
  }
}

// Wait until every live member arrived; members must meet at the same source line.
inline void wait(Barrier& b, int line) {
  if (b.arrived == 0) b.line = line;
  else if (b.line != line) fail("divergent control flow: threads met at different sync points", line);
  uint64_t gen = b.generation;
  if (++b.arrived >= b.expected) {
    b.arrived = 0;
    b.generation++;
    g_sched->progress++;
    return;
  }
  while (b.generation == gen && !g_sched->error) yield();
}

// Phase 1: publish; wait; combine from the slots of the lanes that arrived; wait again so no lane
// overwrites its slot before every lane has read.
template <class T, class F>
T exchange(T v, int line, F combine) {
  static_assert(sizeof(T) <= 16, "simd value too large");
  SimdGroup& sg = g_sched->sgs[me().sg];
  uint lane = me().lane;
  std::memcpy(sg.slot[lane], &v, sizeof(T));
  sg.present[lane] = true;
  wait(sg.bar, line);
  auto get = [&](uint l, T& out) {
    if (l >= uint(kSimdWidth) || !sg.present[l]) return false;
    std::memcpy(&out, sg.slot[l], sizeof(T));
    return true;
  };
  T r = combine(lane, get);
  wait(sg.bar, line);
  sg.present[lane] = false;
  return r;
}

inline void fiber_entry(unsigned lo, unsigned hi) {
  int i = int((uint64_t(hi) << 32 | lo) & 0xffffffff);
  Sched* s = g_sched;
  s->body(s->info[i]);
  Fiber& f = s->fibers[i];
  f.done = true;
  s->progress++;
  // A finished lane is an inactive lane: later simd operations no longer wait for it.
  Barrier& sb = s->sgs[f.sg].bar;
  sb.expected--;
  if (sb.arrived > 0 && sb.arrived >= sb.expected) {
    sb.arrived = 0;
    sb.generation++;
  }
  // A threadgroup barrier must be reached by every thread: finishing while others wait is an error.
  s->tg_bar.expected--;
  if (s->tg_bar.arrived > 0) fail("threadgroup_barrier not reached by every thread", -1);
}

// Runs body for every thread of the grid. Returns 0, or the line of the failed check (or -1).
inline int launch(const uint grid[3], const uint tg[3], std::function<void(const Thread&)> body,
                  const char** error) {
  Sched s;
  g_sched = &s;
  s.body = std::move(body);
  const uint groups[3] = {(grid[0] + tg[0] - 1) / tg[0], (grid[1] + tg[1] - 1) / tg[1],
                          (grid[2] + tg[2] - 1) / tg[2]};
  const size_t max_threads = size_t(tg[0]) * tg[1] * tg[2];
  s.stacks.resize(max_threads * kStack);
  for (uint gz = 0; gz < groups[2] && !s.error; gz++)
    for (uint gy = 0; gy < groups[1] && !s.error; gy++)
      for (uint gx = 0; gx < groups[0] && !s.error; gx++) {
        // Non-uniform grids: the last threadgroup along an axis keeps only the threads inside the grid.
        const uint n[3] = {std::min(tg[0], grid[0] - gx * tg[0]), std::min(tg[1], grid[1] - gy * tg[1]),
                           std::min(tg[2], grid[2] - gz * tg[2])};
        const int count = int(n[0] * n[1] * n[2]);
        s.fibers.assign(count, Fiber{});
        s.info.assign(count, Thread{});
        s.sgs.assign((count + kSimdWidth - 1) / kSimdWidth, SimdGroup{});
        s.tg_bar = Barrier{};
        s.tg_bar.expected = count;
        for (int i = 0; i < count; i++) {
          uint x = i % n[0], y = (i / n[0]) % n[1], z = i / (n[0] * n[1]);
          Thread& t = s.info[i];
          t.tpitg = {x, y, z};
          t.tgpig = {gx, gy, gz};
          t.tg_size = {n[0], n[1], n[2]};
          t.tpig = {gx * tg[0] + x, gy * tg[1] + y, gz * tg[2] + z};
          t.index_in_tg = uint(i);
          Fiber& f = s.fibers[i];
          f.lane = uint(i) % kSimdWidth;
          f.sg = uint(i) / kSimdWidth;
          s.sgs[f.sg].bar.expected++;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = s.stacks.data() + size_t(i) * kStack;
          f.ctx.uc_stack.ss_size = kStack;
          f.ctx.uc_link = &s.main;
          uint64_t arg = uint64_t(i);
          makecontext(&f.ctx, (void (*)())fiber_entry, 2, unsigned(arg), unsigned(arg >> 32));
        }
        int live = count;
        while (live > 0 && !s.error) {
          uint64_t before = s.progress;
          for (int i = 0; i < count && !s.error; i++) {
            if (s.fibers[i].done) continue;
            s.current = i;
            swapcontext(&s.main, &s.fibers[i].ctx);
          }
          live = 0;
          for (auto& f : s.fibers) live += !f.done;
          if (live > 0 && s.progress == before) fail("deadlock: threads wait at a sync point forever", -1);
        }
      }
  g_sched = nullptr;
  if (s.error) {
    *error = s.error;
    return s.error_line < 0 ? -1 : s.error_line;
  }
  return 0;
}

inline const Thread& self() { return g_sched->info[g_sched->current]; }

}  // namespace emu

// ---------------------------------------------------------------- Metal standard library subset
namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

EMU_RUNTIME inline void threadgroup_barrier_at(int line, mem_flags) { emu::wait(emu::g_sched->tg_bar, line); }
EMU_RUNTIME inline void simdgroup_barrier_at(int line, mem_flags) {
  emu::exchange<int>(0, line, [](uint, auto&&) { return 0; });
}

template <class T>
EMU_RUNTIME T simd_sum_at(int line, T v) {
  return emu::exchange<T>(v, line, [](uint, auto&& get) {
    // Lane order like a tree reduction would not matter for exact types; for floats Metal's
    // order is unspecified, so any fixed order is as faithful as another.
    T acc = T(0), x;
    for (uint l = 0; l < uint(emu::kSimdWidth); l++)
      if (get(l, x)) acc += x;
    return acc;
  });
}
template <class T>
EMU_RUNTIME T simd_max_at(int line, T v) {
  return emu::exchange<T>(v, line, [v](uint, auto&& get) {
    T acc = v, x;
    for (uint l = 0; l < uint(emu::kSimdWidth); l++)
      if (get(l, x) && x > acc) acc = x;
    return acc;
  });
}
// Reading an inactive lane is undefined in Metal; the emulator returns NaN/garbage-free 0.
template <class T>
EMU_RUNTIME T simd_shuffle_at(int line, T v, uint src) {
  return emu::exchange<T>(v, line, [src](uint, auto&& get) {
    T x{};
    get(src, x);
    return x;
  });
}
template <class T>
EMU_RUNTIME T simd_shuffle_xor_at(int line, T v, uint mask) {
  return emu::exchange<T>(v, line, [mask](uint lane, auto&& get) {
    T x{};
    get(lane ^ mask, x);
    return x;
  });
}
template <class T>
EMU_RUNTIME T simd_shuffle_down_at(int line, T v, uint delta) {
  return emu::exchange<T>(v, line, [v, delta](uint lane, auto&& get) {
    T x = v;  // lanes past the end keep their own value, as in Metal
    get(lane + delta, x);
    return x;
  });
}
template <class T>
EMU_RUNTIME T simd_shuffle_up_at(int line, T v, uint delta) {
  return emu::exchange<T>(v, line, [v, delta](uint lane, auto&& get) {
    T x = v;
    if (lane >= delta) get(lane - delta, x);
    return x;
  });
}

using std::abs;
using std::ceil;
using std::exp;
using std::exp2;
using std::fabs;
using std::floor;
using std::fma;
using std::isinf;
using std::isnan;
using std::log;
using std::rint;
using std::round;
using std::sqrt;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
template <class T>
T max(T a, T b) { return a > b ? a : b; }
template <class T>
T min(T a, T b) { return a < b ? a : b; }
template <class T>
T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }
template <class T>
T select(T a, T b, bool c) { return c ? b : a; }
inline uint popcount(uint x) { return uint(__builtin_popcount(x)); }
namespace fast {
using std::exp;
using std::exp2;
using std::log;
using std::sqrt;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace fast
namespace precise {
using std::exp;
inline float divide(float a, float b) { return a / b; }
}  // namespace precise

}  // namespace metal

// Metal's bit reinterpretation between same-size types.
template <class T, class U>
T as_type(U v) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  T out;
  std::memcpy(&out, &v, sizeof(T));
  return out;
}

// Call sites are part of the simd/barrier contract (see emu::wait), so the builtins carry __LINE__.
#define simd_sum(...) simd_sum_at(__LINE__, __VA_ARGS__)
#define simd_max(...) simd_max_at(__LINE__, __VA_ARGS__)
#define simd_shuffle(...) simd_shuffle_at(__LINE__, __VA_ARGS__)
#define simd_shuffle_xor(...) simd_shuffle_xor_at(__LINE__, __VA_ARGS__)
#define simd_shuffle_down(...) simd_shuffle_down_at(__LINE__, __VA_ARGS__)
#define simd_shuffle_up(...) simd_shuffle_up_at(__LINE__, __VA_ARGS__)
#define threadgroup_barrier(...) threadgroup_barrier_at(__LINE__, __VA_ARGS__)
#define simdgroup_barrier(...) simdgroup_barrier_at(__LINE__, __VA_ARGS__)

using namespace metal;
