// The CUDA device environment on the CPU: what gpukv's kernel sources (and CUDA kernels
// commonly) use, so that the same source text compiles with g++ into a shared object.
//
// Every kernel source is compiled with `-include emu.h`; kernels.py appends one
// GPUKV_EMU_KERNEL(name) line per kernel, which exports a launcher and a parameter
// description. The launcher hands each thread to the runtime (runtime.cpp), which runs the
// blocks one after another on the calling thread: one plain call per thread, or, when the
// source synchronises, one fiber per thread switched at every __syncthreads().
#pragma once

#include <limits.h>
#include <math.h>  // libstdc++'s math.h: the float overloads (sqrt(float) is sqrtf)
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <type_traits>
#include <utility>

// ------------------------------------------------------------------ compiler identity
#define __CUDACC__ 1
#define __CUDACC_RTC__ 1
#define __CUDA_ARCH__ 700  // the oldest GPU generation gpukv's kernels are built for

// ------------------------------------------------------------------------ qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ static  // blocks run one after another, so one copy serves them all
#define __constant__
#define __managed__
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// __restrict__ is a g++ keyword already.

// ------------------------------------------------------------------- ABI with runtime
extern "C" {

// One launch, as kernels.py fills it in.
struct gpukv_emu_config {
    uint32_t grid[3];
    uint32_t block[3];
    uint64_t shared_mem;  // bytes of dynamic shared memory
    int32_t fibers;       // 1: the source synchronises, run each thread as a fiber
    int32_t ftz;          // 1: float32 subnormals read or made are zero (-ftz=true)
};

enum gpukv_emu_status {
    GPUKV_EMU_OK = 0,
    GPUKV_EMU_SIGNAL = 1,           // SIGSEGV/SIGBUS/SIGFPE/SIGILL in a thread
    GPUKV_EMU_BARRIER = 2,          // threads of a block disagree at __syncthreads()
    GPUKV_EMU_STACK_OVERFLOW = 3,   // a fiber ran past its stack
    GPUKV_EMU_TRAP = 4,             // __trap() or a failed assert()
    GPUKV_EMU_INTERNAL = 5,
};

// What happened, for kernels.py to turn into an exception.
struct gpukv_emu_result {
    int32_t status;
    int32_t signo;
    int32_t sigcode;
    int32_t access;  // 0 unknown, 1 read, 2 write
    uint64_t address;
    uint32_t block[3];
    uint32_t thread[3];
    int32_t line;
    int32_t reserved;
    char message[4096];
};

// A kernel parameter, as the compiler sees it.
enum gpukv_emu_kind { GPUKV_EMU_POINTER = 0, GPUKV_EMU_FLOAT = 1, GPUKV_EMU_INT = 2,
                      GPUKV_EMU_OTHER = 3 };

struct gpukv_emu_param {
    uint64_t size;
    int32_t kind;
    int32_t align;
    const char* type;  // "[with T = ...]" text of __PRETTY_FUNCTION__
};

void gpukv_emu_run(const struct gpukv_emu_config* config, void (*thread)(void*),
                   void* closure, struct gpukv_emu_result* result);
int gpukv_emu_barrier(int line, int predicate);
void gpukv_emu_trap(const char* what, const char* file, int line) __attribute__((noreturn));
uint64_t gpukv_emu_clock(void);

}  // extern "C"

// ----------------------------------------------------------------- built-in variables
struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

#ifdef GPUKV_EMU_RUNTIME
#define GPUKV_EMU_BUILTIN
#else
#define GPUKV_EMU_BUILTIN const  // kernels read them; only the runtime sets them
#endif
extern "C" GPUKV_EMU_BUILTIN uint3 gpukv_emu_threadIdx;
extern "C" GPUKV_EMU_BUILTIN uint3 gpukv_emu_blockIdx;
extern "C" GPUKV_EMU_BUILTIN dim3 gpukv_emu_blockDim;
extern "C" GPUKV_EMU_BUILTIN dim3 gpukv_emu_gridDim;
extern "C" unsigned char gpukv_emu_dynamic_shared[];

static const uint3& threadIdx = gpukv_emu_threadIdx;
static const uint3& blockIdx = gpukv_emu_blockIdx;
static const dim3& blockDim = gpukv_emu_blockDim;
static const dim3& gridDim = gpukv_emu_gridDim;
static const int warpSize = 32;

// ---------------------------------------------------------------------- vector types
#define GPUKV_EMU_VEC2(T, N, A) \
    struct __attribute__((aligned(A))) N##2 { T x, y; }; \
    static inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define GPUKV_EMU_VEC3(T, N) \
    struct N##3 { T x, y, z; }; \
    static inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define GPUKV_EMU_VEC4(T, N, A) \
    struct __attribute__((aligned(A))) N##4 { T x, y, z, w; }; \
    static inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
GPUKV_EMU_VEC2(char, char, 2) GPUKV_EMU_VEC4(char, char, 4)
GPUKV_EMU_VEC2(unsigned char, uchar, 2) GPUKV_EMU_VEC4(unsigned char, uchar, 4)
GPUKV_EMU_VEC2(short, short, 4) GPUKV_EMU_VEC4(short, short, 8)
GPUKV_EMU_VEC2(unsigned short, ushort, 4) GPUKV_EMU_VEC4(unsigned short, ushort, 8)
GPUKV_EMU_VEC2(int, int, 8) GPUKV_EMU_VEC3(int, int) GPUKV_EMU_VEC4(int, int, 16)
GPUKV_EMU_VEC2(unsigned int, uint, 8) GPUKV_EMU_VEC4(unsigned int, uint, 16)
GPUKV_EMU_VEC2(long long, longlong, 16) GPUKV_EMU_VEC2(unsigned long long, ulonglong, 16)
GPUKV_EMU_VEC2(float, float, 8) GPUKV_EMU_VEC3(float, float) GPUKV_EMU_VEC4(float, float, 16)
GPUKV_EMU_VEC2(double, double, 16) GPUKV_EMU_VEC3(double, double)
GPUKV_EMU_VEC4(double, double, 16)
static inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) {
    return uint3{x, y, z};
}

// ---------------------------------------------------------------- synchronisation
// The call site identifies the barrier: threads of a block must all reach the same one.
#define __syncthreads() ((void)gpukv_emu_barrier(__LINE__, 0))
#define __syncthreads_count(p) gpukv_emu_barrier(__LINE__, (p) ? 1 : 0)
#define __syncthreads_and(p) \
    (gpukv_emu_barrier(__LINE__, (p) ? 1 : 0) == (int)(blockDim.x * blockDim.y * blockDim.z))
#define __syncthreads_or(p) (gpukv_emu_barrier(__LINE__, (p) ? 1 : 0) != 0)
// __syncwarp() orders a warp's shared-memory accesses. Here it is the whole block's
// barrier: stricter than CUDA's (every thread of the block must reach it, not only the
// warp's), which gpukv's kernels satisfy by running their warps in step.
#define __syncwarp(...) ((void)gpukv_emu_barrier(__LINE__, 0))
// One OS thread runs a launch, and launches are serialised: memory is always coherent.
static inline void __threadfence() {}
static inline void __threadfence_block() {}
static inline void __threadfence_system() {}

#define __trap() gpukv_emu_trap("__trap()", __FILE__, __LINE__)
#undef assert
#define assert(e) ((e) ? (void)0 : gpukv_emu_trap("assertion `" #e "' failed", __FILE__, __LINE__))

static inline long long clock64() { return (long long)gpukv_emu_clock(); }

template <class T> static inline T __ldg(const T* p) { return *p; }

// ------------------------------------------------------------------------ atomics
// Plain read-modify-write: a launch runs on one OS thread and launches are serialised.
#define GPUKV_EMU_ATOMIC(NAME, T, EXPR) \
    static inline T NAME(T* address, T val) { T old = *address; *address = (EXPR); return old; }
GPUKV_EMU_ATOMIC(atomicAdd, int, old + val)
GPUKV_EMU_ATOMIC(atomicAdd, unsigned int, old + val)
GPUKV_EMU_ATOMIC(atomicAdd, unsigned long long, old + val)
GPUKV_EMU_ATOMIC(atomicAdd, float, old + val)
GPUKV_EMU_ATOMIC(atomicAdd, double, old + val)
GPUKV_EMU_ATOMIC(atomicSub, int, old - val)
GPUKV_EMU_ATOMIC(atomicSub, unsigned int, old - val)
GPUKV_EMU_ATOMIC(atomicExch, int, val)
GPUKV_EMU_ATOMIC(atomicExch, unsigned int, val)
GPUKV_EMU_ATOMIC(atomicExch, unsigned long long, val)
GPUKV_EMU_ATOMIC(atomicExch, float, val)
GPUKV_EMU_ATOMIC(atomicMax, int, old > val ? old : val)
GPUKV_EMU_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
GPUKV_EMU_ATOMIC(atomicMax, long long, old > val ? old : val)
GPUKV_EMU_ATOMIC(atomicMax, unsigned long long, old > val ? old : val)
GPUKV_EMU_ATOMIC(atomicMin, int, old < val ? old : val)
GPUKV_EMU_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
GPUKV_EMU_ATOMIC(atomicMin, long long, old < val ? old : val)
GPUKV_EMU_ATOMIC(atomicMin, unsigned long long, old < val ? old : val)
GPUKV_EMU_ATOMIC(atomicAnd, int, old & val)
GPUKV_EMU_ATOMIC(atomicAnd, unsigned int, old & val)
GPUKV_EMU_ATOMIC(atomicAnd, unsigned long long, old & val)
GPUKV_EMU_ATOMIC(atomicOr, int, old | val)
GPUKV_EMU_ATOMIC(atomicOr, unsigned int, old | val)
GPUKV_EMU_ATOMIC(atomicOr, unsigned long long, old | val)
GPUKV_EMU_ATOMIC(atomicXor, int, old ^ val)
GPUKV_EMU_ATOMIC(atomicXor, unsigned int, old ^ val)
GPUKV_EMU_ATOMIC(atomicXor, unsigned long long, old ^ val)
GPUKV_EMU_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
GPUKV_EMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef GPUKV_EMU_ATOMIC
#define GPUKV_EMU_CAS(T) \
    static inline T atomicCAS(T* address, T compare, T val) { \
        T old = *address; if (old == compare) *address = val; return old; }
GPUKV_EMU_CAS(int)
GPUKV_EMU_CAS(unsigned int)
GPUKV_EMU_CAS(unsigned long long)
GPUKV_EMU_CAS(unsigned short)
#undef GPUKV_EMU_CAS

// --------------------------------------------------------------- bit reinterpretation
template <class To, class From> static inline To gpukv_emu_bits(From v) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To out;
    memcpy(&out, &v, sizeof out);
    return out;
}
static inline unsigned int __float_as_uint(float x) { return gpukv_emu_bits<unsigned int>(x); }
static inline int __float_as_int(float x) { return gpukv_emu_bits<int>(x); }
static inline float __uint_as_float(unsigned int x) { return gpukv_emu_bits<float>(x); }
static inline float __int_as_float(int x) { return gpukv_emu_bits<float>(x); }
static inline long long __double_as_longlong(double x) { return gpukv_emu_bits<long long>(x); }
static inline double __longlong_as_double(long long x) { return gpukv_emu_bits<double>(x); }
static inline int __double2hiint(double x) {
    return (int)(gpukv_emu_bits<unsigned long long>(x) >> 32);
}
static inline int __double2loint(double x) { return (int)gpukv_emu_bits<unsigned long long>(x); }

// ------------------------------------------------------------- arithmetic intrinsics
// Correctly rounded, never contracted (the source is compiled with -ffp-contract=off).
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __drcp_rn(double a) { return 1.0 / a; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
// Fast-math variants: the GPU approximates them; here they are the exact functions
// (glibc's math.h declares __expf, __logf, __powf, __sinf and __cosf already).
static inline float __fdividef(float a, float b) { return a / b; }
static inline float fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float __saturatef(float x) { return x > 1.0f ? 1.0f : (x >= 0.0f ? x : 0.0f); }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline int __float2int_rz(float x) { return (int)x; }
static inline unsigned int __float2uint_rn(float x) { return (unsigned int)nearbyintf(x); }
static inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
static inline int __double2int_rn(double x) { return (int)nearbyint(x); }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned int x) { return (float)x; }
static inline double __int2double_rn(int x) { return (double)x; }
static inline float __ll2float_rn(long long x) { return (float)x; }

// Integer intrinsics and CUDA's min/max overloads.
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned int)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
#define GPUKV_EMU_MINMAX(T) \
    static inline T min(T a, T b) { return a < b ? a : b; } \
    static inline T max(T a, T b) { return a > b ? a : b; }
GPUKV_EMU_MINMAX(int)
GPUKV_EMU_MINMAX(unsigned int)
GPUKV_EMU_MINMAX(long long)
GPUKV_EMU_MINMAX(unsigned long long)
#undef GPUKV_EMU_MINMAX
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }

// ---------------------------------------------------------------- 16-bit floats
// Conversions by bit arithmetic, rounding to nearest even, as NumPy (float16) and
// ml_dtypes (bfloat16) convert: subnormals kept, overflow to inf, NaN stays NaN (float16
// keeps the payload's top bits as NumPy does; bfloat16 gives ml_dtypes' quiet NaN).

// The float16 bits nearest to a value of `magnitude` bits (IEEE binary32, sign cleared).
static inline unsigned int gpukv_emu_half_magnitude(unsigned int ax) {
    if (ax > 0x7f800000u) {  // NaN: the payload's top ten bits, made nonzero
        unsigned int m = (ax >> 13) & 0x3ffu;
        return 0x7c00u | (m ? m : 1u);
    }
    if (ax >= 0x477ff000u) return 0x7c00u;  // from 65520 up (and inf): inf
    if (ax >= 0x38800000u) {                 // a normal float16
        unsigned int r = ax - 0x38000000u;   // rebias the exponent (127 -> 15)
        unsigned int h = r >> 13, rest = r & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
        return h;
    }
    if (ax <= 0x33000000u) return 0;         // up to 2**-25 (a tie with zero): zero
    // A float16 subnormal: the value in units of 2**-24.
    unsigned int e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    unsigned int shift = 126u - e;           // 14..24
    unsigned int h = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return h;
}

static inline unsigned short gpukv_emu_float_to_half_bits(float f) {
    unsigned int x = __float_as_uint(f);
    return (unsigned short)(((x >> 16) & 0x8000u) | gpukv_emu_half_magnitude(x & 0x7fffffffu));
}

static inline float gpukv_emu_half_bits_to_float(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int e = ((unsigned int)h >> 10) & 0x1fu, m = (unsigned int)h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));  // inf, NaN
    if (e != 0) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return __uint_as_float(sign);
    int shift = __builtin_clz(m) - 21;  // normalise the subnormal: bit 10 becomes the lead
    m = (m << shift) & 0x3ffu;
    return __uint_as_float(sign | ((113u - (unsigned int)shift) << 23) | (m << 13));
}

static inline unsigned short gpukv_emu_float_to_bfloat16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

static inline float gpukv_emu_bfloat16_bits_to_float(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// A double rounded to float toward zero with the last bit set if inexact ("round to
// odd"): rounding that to a 16-bit float gives the double's nearest, as float has more
// than two bits beyond either 16-bit format.
static inline float gpukv_emu_round_to_odd_float(double d) {
    float f = (float)d;
    if (d == d && (double)f != d) {
        unsigned int u = __float_as_uint(f);
        if (fabs((double)f) > fabs(d)) u -= 1u;  // f rounded away from zero: step back
        f = __uint_as_float(u | 1u);
    }
    return f;
}

static inline unsigned short gpukv_emu_double_to_half_bits(double d) {
    return gpukv_emu_float_to_half_bits(gpukv_emu_round_to_odd_float(d));
}

static inline unsigned short gpukv_emu_double_to_bfloat16_bits(double d) {
    return gpukv_emu_float_to_bfloat16_bits(gpukv_emu_round_to_odd_float(d));
}

struct __half_raw { unsigned short x; };
struct __nv_bfloat16_raw { unsigned short x; };

// A 16-bit float; arithmetic through float (exact for +, -, *, /: float has the bits).
#define GPUKV_EMU_BINARY(T, R, OP) \
    static inline R operator OP(const T& a, const T& b) { return R((float)a OP (float)b); }
#define GPUKV_EMU_FLOAT16(NAME, TO_BITS, FROM_BITS, D_TO_BITS) \
    struct NAME { \
        unsigned short __x; \
        NAME() = default; \
        constexpr NAME(const NAME##_raw& r) : __x(r.x) {} \
        NAME(float f) : __x(TO_BITS(f)) {} \
        NAME(double d) : __x(D_TO_BITS(d)) {} \
        NAME(int i) : __x(TO_BITS((float)i)) {} \
        NAME(unsigned int i) : __x(TO_BITS((float)i)) {} \
        NAME(long long i) : __x(TO_BITS((float)i)) {} \
        NAME(unsigned long long i) : __x(TO_BITS((float)i)) {} \
        NAME(short i) : __x(TO_BITS((float)i)) {} \
        NAME(unsigned short i) : __x(TO_BITS((float)i)) {} \
        operator NAME##_raw() const { return NAME##_raw{__x}; } \
        operator float() const { return FROM_BITS(__x); } \
        NAME& operator+=(const NAME& o) { return *this = NAME((float)*this + (float)o); } \
        NAME& operator-=(const NAME& o) { return *this = NAME((float)*this - (float)o); } \
        NAME& operator*=(const NAME& o) { return *this = NAME((float)*this * (float)o); } \
        NAME& operator/=(const NAME& o) { return *this = NAME((float)*this / (float)o); } \
    }; \
    static inline NAME operator-(const NAME& a) { NAME r; r.__x = a.__x ^ 0x8000u; return r; } \
    GPUKV_EMU_BINARY(NAME, NAME, +) GPUKV_EMU_BINARY(NAME, NAME, -) \
    GPUKV_EMU_BINARY(NAME, NAME, *) GPUKV_EMU_BINARY(NAME, NAME, /) \
    GPUKV_EMU_BINARY(NAME, bool, ==) GPUKV_EMU_BINARY(NAME, bool, !=) \
    GPUKV_EMU_BINARY(NAME, bool, <) GPUKV_EMU_BINARY(NAME, bool, <=) \
    GPUKV_EMU_BINARY(NAME, bool, >) GPUKV_EMU_BINARY(NAME, bool, >=)
GPUKV_EMU_FLOAT16(__half, gpukv_emu_float_to_half_bits, gpukv_emu_half_bits_to_float,
                  gpukv_emu_double_to_half_bits)
GPUKV_EMU_FLOAT16(__nv_bfloat16, gpukv_emu_float_to_bfloat16_bits,
                  gpukv_emu_bfloat16_bits_to_float, gpukv_emu_double_to_bfloat16_bits)
#undef GPUKV_EMU_FLOAT16
#undef GPUKV_EMU_BINARY
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

static inline __half gpukv_emu_half_of_bits(unsigned short x) { __half h; h.__x = x; return h; }
static inline __nv_bfloat16 gpukv_emu_bfloat16_of_bits(unsigned short x) {
    __nv_bfloat16 b; b.__x = x; return b;
}
static inline __half __float2half(float f) {
    return gpukv_emu_half_of_bits(gpukv_emu_float_to_half_bits(f));
}
static inline __half __float2half_rn(float f) { return __float2half(f); }
static inline __half __double2half(double d) {
    return gpukv_emu_half_of_bits(gpukv_emu_double_to_half_bits(d));
}
static inline float __half2float(__half h) { return gpukv_emu_half_bits_to_float(h.__x); }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline short __half_as_short(__half h) { return (short)h.__x; }
static inline __half __ushort_as_half(unsigned short x) { return gpukv_emu_half_of_bits(x); }
static inline __half __short_as_half(short x) {
    return gpukv_emu_half_of_bits((unsigned short)x);
}
static inline __nv_bfloat16 __float2bfloat16(float f) {
    return gpukv_emu_bfloat16_of_bits(gpukv_emu_float_to_bfloat16_bits(f));
}
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
static inline __nv_bfloat16 __double2bfloat16(double d) {
    return gpukv_emu_bfloat16_of_bits(gpukv_emu_double_to_bfloat16_bits(d));
}
static inline float __bfloat162float(__nv_bfloat16 b) {
    return gpukv_emu_bfloat16_bits_to_float(b.__x);
}
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
static inline short __bfloat16_as_short(__nv_bfloat16 b) { return (short)b.__x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) {
    return gpukv_emu_bfloat16_of_bits(x);
}
static inline __nv_bfloat16 __short_as_bfloat16(short x) {
    return gpukv_emu_bfloat16_of_bits((unsigned short)x);
}
#define GPUKV_EMU_HALF_OPS(T) \
    static inline T __hadd(T a, T b) { return a + b; } \
    static inline T __hsub(T a, T b) { return a - b; } \
    static inline T __hmul(T a, T b) { return a * b; } \
    static inline T __hdiv(T a, T b) { return a / b; } \
    static inline T __hneg(T a) { return -a; } \
    static inline bool __heq(T a, T b) { return a == b; } \
    static inline bool __hlt(T a, T b) { return a < b; } \
    static inline bool __hgt(T a, T b) { return a > b; } \
    static inline bool __hisnan(T a) { return (float)a != (float)a; }
GPUKV_EMU_HALF_OPS(__half)
GPUKV_EMU_HALF_OPS(__nv_bfloat16)
#undef GPUKV_EMU_HALF_OPS

// ------------------------------------------------------------------- inline PTX
// kernels.py rewrites each known asm statement into a call of one of these.
static inline float gpukv_emu_cvt_f32_f16(unsigned short h) {
    return gpukv_emu_half_bits_to_float(h);
}
static inline unsigned short gpukv_emu_cvt_rn_f16_f32(float f) {
    return gpukv_emu_float_to_half_bits(f);
}
// Explicit PTX without .ftz (add.rn.f32, cvt.rn.f32.f64, cvt.f64.f32, cvt.rn.f16.f64)
// keeps float32 subnormals, operands and results, while launches run with the CPU's
// flush-to-zero switches on (as -ftz=true has compiler-made arithmetic do): they are off
// between gpukv_emu_unflushed_begin() and gpukv_emu_unflushed_end(saved). The operands
// go through volatiles, so the operation stays between the two.
#if defined(__x86_64__) || defined(__i386__)
typedef unsigned int gpukv_emu_float_control;
static inline gpukv_emu_float_control gpukv_emu_unflushed_begin() {
    unsigned int saved, plain;
    asm volatile("stmxcsr %0" : "=m"(saved) : : "memory");
    plain = saved & ~((1u << 15) | (1u << 6));  // FTZ, DAZ
    asm volatile("ldmxcsr %0" : : "m"(plain) : "memory");
    return saved;
}
static inline void gpukv_emu_unflushed_end(gpukv_emu_float_control saved) {
    asm volatile("ldmxcsr %0" : : "m"(saved) : "memory");
}
#elif defined(__aarch64__)
typedef unsigned long long gpukv_emu_float_control;
static inline gpukv_emu_float_control gpukv_emu_unflushed_begin() {
    unsigned long long saved, plain;
    asm volatile("mrs %0, fpcr" : "=r"(saved) : : "memory");
    plain = saved & ~(1ull << 24);  // FPCR.FZ
    asm volatile("msr fpcr, %0" : : "r"(plain) : "memory");
    return saved;
}
static inline void gpukv_emu_unflushed_end(gpukv_emu_float_control saved) {
    asm volatile("msr fpcr, %0" : : "r"(saved) : "memory");
}
#else  // elsewhere launches do not flush (runtime.cpp)
typedef int gpukv_emu_float_control;
static inline gpukv_emu_float_control gpukv_emu_unflushed_begin() { return 0; }
static inline void gpukv_emu_unflushed_end(gpukv_emu_float_control) {}
#endif

static inline float gpukv_emu_add_rn_f32(float a, float b) {
    volatile float x = a, y = b, r;
    const gpukv_emu_float_control saved = gpukv_emu_unflushed_begin();
    r = x + y;
    gpukv_emu_unflushed_end(saved);
    return r;
}
static inline float gpukv_emu_cvt_rn_f32_f64(double d) {
    volatile double x = d;
    volatile float r;
    const gpukv_emu_float_control saved = gpukv_emu_unflushed_begin();
    r = (float)x;
    gpukv_emu_unflushed_end(saved);
    return r;
}
static inline double gpukv_emu_cvt_f64_f32(float f) {
    volatile float x = f;
    volatile double r;
    const gpukv_emu_float_control saved = gpukv_emu_unflushed_begin();
    r = (double)x;
    gpukv_emu_unflushed_end(saved);
    return r;
}
// float64 -> float16 rounded once (round to odd into float, then to nearest even), as
// NumPy casts; unflushed, as the GPU's conversion has no float32 step that could flush.
static inline unsigned short gpukv_emu_cvt_rn_f16_f64(double d) {
    volatile double x = d;
    volatile unsigned short r;
    const gpukv_emu_float_control saved = gpukv_emu_unflushed_begin();
    r = gpukv_emu_double_to_half_bits(x);
    gpukv_emu_unflushed_end(saved);
    return r;
}

// ------------------------------------------------------------- kernel export
namespace gpukv_emu {

template <class T> const char* type_name() { return __PRETTY_FUNCTION__; }

template <class T> constexpr int kind_of() {
    return std::is_pointer<T>::value ? GPUKV_EMU_POINTER
         : std::is_floating_point<T>::value ? GPUKV_EMU_FLOAT
         : (std::is_integral<T>::value || std::is_enum<T>::value) ? GPUKV_EMU_INT
         : GPUKV_EMU_OTHER;
}

template <class... P> int describe(void (*)(P...), gpukv_emu_param* out, int capacity) {
    const gpukv_emu_param params[] = {
        {sizeof(P), kind_of<P>(), (int32_t)alignof(P), type_name<P>()}...,
        {0, 0, 0, nullptr}};
    const int n = (int)sizeof...(P);
    for (int i = 0; i < n && i < capacity; ++i) out[i] = params[i];
    return n;
}

// The kernel and its argument array (each entry points at a parameter's bytes).
template <class... P> struct Closure {
    void (*kernel)(P...);
    void** args;
};

template <class... P, size_t... I>
inline void call(const Closure<P...>* c, std::index_sequence<I...>) {
    c->kernel(*static_cast<P*>(c->args[I])...);
}

template <class... P> void run_thread(void* closure) {
    call(static_cast<const Closure<P...>*>(closure), std::index_sequence_for<P...>{});
}

template <class... P>
void launch(void (*kernel)(P...), const gpukv_emu_config* config, void** args,
            gpukv_emu_result* result) {
    Closure<P...> closure{kernel, args};
    gpukv_emu_run(config, &run_thread<P...>, &closure, result);
}

}  // namespace gpukv_emu

#define GPUKV_EMU_KERNEL(name) \
    extern "C" __attribute__((visibility("default"))) int gpukv_emu_describe__##name( \
            gpukv_emu_param* out, int capacity) { \
        return gpukv_emu::describe(&name, out, capacity); } \
    extern "C" __attribute__((visibility("default"))) void gpukv_emu_launch__##name( \
            const gpukv_emu_config* config, void** args, gpukv_emu_result* result) { \
        gpukv_emu::launch(&name, config, args, result); }
