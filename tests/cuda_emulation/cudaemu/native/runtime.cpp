// The launcher every compiled kernel calls: runs a grid block after block on the calling
// thread, turns faults into a result instead of a dead process, and checks barriers.
//
// Built once into its own shared object, loaded with RTLD_GLOBAL before any kernel, so
// every kernel shares the built-in variables, the fiber stacks and the signal handling.
// kernels.py serialises launches, so the state below belongs to one launch at a time.
#define GPUKV_EMU_RUNTIME
#include "emu.h"

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#if !defined(__x86_64__) && !defined(GPUKV_EMU_UCONTEXT)
#define GPUKV_EMU_UCONTEXT 1
#endif
#ifdef GPUKV_EMU_UCONTEXT
#include <ucontext.h>
#endif

extern "C" {
__attribute__((visibility("default"))) uint3 gpukv_emu_threadIdx;
__attribute__((visibility("default"))) uint3 gpukv_emu_blockIdx;
__attribute__((visibility("default"))) dim3 gpukv_emu_blockDim;
__attribute__((visibility("default"))) dim3 gpukv_emu_gridDim;
// Dynamic (extern __shared__) memory: the most a GPU lets one block opt in to.
__attribute__((visibility("default"), aligned(256))) unsigned char
    gpukv_emu_dynamic_shared[232448];
}

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ------------------------------------------------------------------------- state
constexpr size_t kStack = 64 * 1024;  // per fiber
constexpr size_t kGuard = 4096;       // PROT_NONE below each stack: overflow faults
constexpr int kMaxThreads = 1024;

enum FiberState { READY, WAITING, DONE };

struct Fiber {
    void* sp;  // saved stack pointer while switched out
#ifdef GPUKV_EMU_UCONTEXT
    ucontext_t context;
#endif
    unsigned char* stack;
    uint3 tid;
    int state;
    int line;       // barrier site while WAITING
    int predicate;  // its __syncthreads_count() argument
};

void (*g_thread)(void*);  // runs one CUDA thread of the current launch
void* g_closure;
gpukv_emu_result* g_result;

bool g_fibers_mode;
Fiber g_fiber[kMaxThreads];
unsigned char* g_stacks;  // kMaxThreads x (guard + stack), made on first use
Fiber* g_current;
void* g_scheduler_sp;
#ifdef GPUKV_EMU_UCONTEXT
ucontext_t g_scheduler;
#endif
int g_barrier_value;  // what the last released barrier returns (its predicate count)

// Faults: where to jump back to, and what was caught.
sigjmp_buf g_escape;
volatile sig_atomic_t g_armed;
pthread_t g_owner;
constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
constexpr int kNumSignals = sizeof kSignals / sizeof kSignals[0];
struct sigaction g_previous[kNumSignals];
stack_t g_previous_altstack;
alignas(16) unsigned char g_altstack[64 * 1024];
int g_escape_status;

void message(const char* format, ...) __attribute__((format(printf, 1, 2)));
void message(const char* format, ...) {
    size_t used = strlen(g_result->message);
    size_t room = sizeof g_result->message - used;
    if (room <= 1) return;
    va_list ap;
    va_start(ap, format);
    vsnprintf(g_result->message + used, room, format, ap);
    va_end(ap);
}

void record_position() {
    g_result->block[0] = gpukv_emu_blockIdx.x;
    g_result->block[1] = gpukv_emu_blockIdx.y;
    g_result->block[2] = gpukv_emu_blockIdx.z;
    g_result->thread[0] = gpukv_emu_threadIdx.x;
    g_result->thread[1] = gpukv_emu_threadIdx.y;
    g_result->thread[2] = gpukv_emu_threadIdx.z;
}

// Leave the running kernel (from a thread or fiber) back to gpukv_emu_run.
[[noreturn]] void escape(int status) {
    g_armed = 0;
    g_escape_status = status;
    siglongjmp(g_escape, 1);
}

// ------------------------------------------------------------------------ signals
int signal_index(int sig) {
    for (int i = 0; i < kNumSignals; ++i)
        if (kSignals[i] == sig) return i;
    return -1;
}

void on_signal(int sig, siginfo_t* info, void* context) {
    if (g_armed && pthread_equal(pthread_self(), g_owner)) {
        g_result->signo = sig;
        g_result->sigcode = info->si_code;
        g_result->address = (uint64_t)(uintptr_t)info->si_addr;
#if defined(__x86_64__) && defined(REG_ERR)
        if (sig == SIGSEGV || sig == SIGBUS) {  // page-fault error code: bit 1 is a write
            long err = ((ucontext_t*)context)->uc_mcontext.gregs[REG_ERR];
            g_result->access = (err & 2) ? 2 : 1;
        }
#endif
        record_position();
        uintptr_t a = (uintptr_t)info->si_addr, base = (uintptr_t)g_stacks;
        bool in_stacks = g_stacks && a >= base && a < base + kMaxThreads * (kGuard + kStack);
        bool overflow = in_stacks && (a - base) % (kGuard + kStack) < kGuard;
        escape(overflow ? GPUKV_EMU_STACK_OVERFLOW : GPUKV_EMU_SIGNAL);
    }
    // Not a kernel's fault (another thread of the process): whoever handled it before.
    const struct sigaction& before = g_previous[signal_index(sig)];
    if ((before.sa_flags & SA_SIGINFO) && before.sa_sigaction) {
        before.sa_sigaction(sig, info, context);
    } else if (before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN) {
        before.sa_handler(sig);
    } else {
        struct sigaction fallback;
        memset(&fallback, 0, sizeof fallback);
        fallback.sa_handler = SIG_DFL;
        sigaction(sig, &fallback, nullptr);  // the fault repeats on return, now fatal
    }
}

void install_handlers() {
    stack_t alt;
    alt.ss_sp = g_altstack;
    alt.ss_size = sizeof g_altstack;
    alt.ss_flags = 0;
    sigaltstack(&alt, &g_previous_altstack);
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_signal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    for (int i = 0; i < kNumSignals; ++i) sigaction(kSignals[i], &action, &g_previous[i]);
}

// Put back what was there (Python's faulthandler, typically).
void restore_handlers() {
    for (int i = 0; i < kNumSignals; ++i) sigaction(kSignals[i], &g_previous[i], nullptr);
    sigaltstack(&g_previous_altstack, nullptr);
}

// ------------------------------------------------------------------------- fibers
bool make_stacks() {
    if (g_stacks) return true;
    size_t slot = kGuard + kStack;
    void* region = mmap(nullptr, slot * kMaxThreads, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED) return false;
    unsigned char* base = static_cast<unsigned char*>(region);
    for (int i = 0; i < kMaxThreads; ++i) mprotect(base + i * slot, kGuard, PROT_NONE);
    g_stacks = base;
    return true;
}

[[noreturn]] void fiber_main();

#ifdef GPUKV_EMU_UCONTEXT
void fiber_start(Fiber* f) {
    getcontext(&f->context);
    f->context.uc_stack.ss_sp = f->stack;
    f->context.uc_stack.ss_size = kStack;
    f->context.uc_link = nullptr;
    makecontext(&f->context, (void (*)())fiber_main, 0);
}
inline void switch_to_fiber(Fiber* f) { swapcontext(&g_scheduler, &f->context); }
inline void switch_to_scheduler(Fiber* f) { swapcontext(&f->context, &g_scheduler); }
#else
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *save and resumes the stack `to` saved the same way.
extern "C" void gpukv_emu_switch(void** save, void* to);
asm(R"(
    .text
    .p2align 4
    .type gpukv_emu_switch, @function
gpukv_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size gpukv_emu_switch, .-gpukv_emu_switch
)");

// A fresh stack that gpukv_emu_switch "returns" into fiber_main from.
void fiber_start(Fiber* f) {
    uint64_t* sp = reinterpret_cast<uint64_t*>(f->stack + kStack);  // 16-byte aligned
    *--sp = 0;                                       // fiber_main's (absent) return address
    *--sp = reinterpret_cast<uint64_t>(&fiber_main);  // where `ret` goes
    for (int i = 0; i < 6; ++i) *--sp = 0;           // rbp rbx r12 r13 r14 r15
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    *--sp = (uint64_t)mxcsr | ((uint64_t)fpucw << 32);
    f->sp = sp;
}
inline void switch_to_fiber(Fiber* f) { gpukv_emu_switch(&g_scheduler_sp, f->sp); }
inline void switch_to_scheduler(Fiber* f) { gpukv_emu_switch(&f->sp, g_scheduler_sp); }
#endif

[[noreturn]] void fiber_main() {
    g_thread(g_closure);
    g_current->state = DONE;
    switch_to_scheduler(g_current);
    __builtin_unreachable();  // a finished fiber is never resumed
}

// "0-31, 64-95" for the threads (linear ids) whose `select` holds.
template <class Select> void list_threads(int n, Select select) {
    bool first = true;
    for (int i = 0; i < n;) {
        if (!select(g_fiber[i])) { ++i; continue; }
        int j = i;
        while (j + 1 < n && select(g_fiber[j + 1])) ++j;
        if (j == i) message("%s%d", first ? "" : ", ", i);
        else message("%s%d-%d", first ? "" : ", ", i, j);
        first = false;
        i = j + 1;
    }
}

// After every thread ran to a barrier or to its end: release the barrier, or explain.
bool release_barrier(int n, bool* finished) {
    int waiting = 0, done = 0, line = -1, other = -1, count = 0;
    for (int i = 0; i < n; ++i) {
        const Fiber& f = g_fiber[i];
        if (f.state == DONE) { ++done; continue; }
        ++waiting;
        count += f.predicate;
        if (line < 0) line = f.line;
        else if (f.line != line && other < 0) other = f.line;
    }
    if (waiting == 0) { *finished = true; return true; }
    if (done == 0 && other < 0) {
        g_barrier_value = count;
        for (int i = 0; i < n; ++i) g_fiber[i].state = READY;
        return true;
    }
    g_result->status = GPUKV_EMU_BARRIER;
    g_result->line = line;
    g_result->block[0] = gpukv_emu_blockIdx.x;
    g_result->block[1] = gpukv_emu_blockIdx.y;
    g_result->block[2] = gpukv_emu_blockIdx.z;
    bool multi = gpukv_emu_blockDim.y > 1 || gpukv_emu_blockDim.z > 1;
    message("threads of one block must all reach the same __syncthreads(): ");
    if (other >= 0) {  // two (or more) sites
        int shown = 0;
        int sites[2] = {line, other};
        for (int s : sites) {
            message("%sthreads ", shown++ ? "; " : "");
            list_threads(n, [s](const Fiber& f) { return f.state == WAITING && f.line == s; });
            message(" wait at the one on line %d", s);
        }
        bool more = false;
        for (int i = 0; i < n; ++i) {
            const Fiber& f = g_fiber[i];
            if (f.state == WAITING && f.line != line && f.line != other) more = true;
        }
        if (more) message("; others wait elsewhere");
        if (done) {
            message("; threads ");
            list_threads(n, [](const Fiber& f) { return f.state == DONE; });
            message(" have returned");
        }
    } else {
        message("threads ");
        list_threads(n, [](const Fiber& f) { return f.state == WAITING; });
        message(" wait at the one on line %d, threads ", line);
        list_threads(n, [](const Fiber& f) { return f.state == DONE; });
        message(" have returned without reaching it");
    }
    if (multi)
        message(" (thread numbers are x + y * blockDim.x + z * blockDim.x * blockDim.y)");
    return false;
}

bool run_block_as_fibers(int n) {
    const dim3& b = gpukv_emu_blockDim;
    for (int i = 0; i < n; ++i) {
        Fiber& f = g_fiber[i];
        f.stack = g_stacks + i * (kGuard + kStack) + kGuard;
        f.tid = uint3{(unsigned)i % b.x, ((unsigned)i / b.x) % b.y, (unsigned)i / (b.x * b.y)};
        f.state = READY;
        f.line = -1;
        f.predicate = 0;
        fiber_start(&f);
    }
    for (;;) {
        for (int i = 0; i < n; ++i) {
            Fiber& f = g_fiber[i];
            if (f.state != READY) continue;
            g_current = &f;
            gpukv_emu_threadIdx = f.tid;
            switch_to_fiber(&f);
        }
        bool finished = false;
        if (!release_barrier(n, &finished)) return false;
        if (finished) return true;
    }
}

void run_grid(const gpukv_emu_config* config) {
    const dim3 g = gpukv_emu_gridDim, b = gpukv_emu_blockDim;
    const int n = (int)(b.x * b.y * b.z);
    for (unsigned bz = 0; bz < g.z; ++bz)
        for (unsigned by = 0; by < g.y; ++by)
            for (unsigned bx = 0; bx < g.x; ++bx) {
                gpukv_emu_blockIdx = uint3{bx, by, bz};
                if (config->shared_mem)  // uninitialised on a GPU: make reliance on it show
                    memset(gpukv_emu_dynamic_shared, 0xff, config->shared_mem);
                if (g_fibers_mode) {
                    if (!run_block_as_fibers(n)) return;
                    continue;
                }
                for (unsigned tz = 0; tz < b.z; ++tz)
                    for (unsigned ty = 0; ty < b.y; ++ty)
                        for (unsigned tx = 0; tx < b.x; ++tx) {
                            gpukv_emu_threadIdx = uint3{tx, ty, tz};
                            g_thread(g_closure);
                        }
            }
}

// ------------------------------------------------------------------ flush to zero
// -ftz=true on a GPU: float32 subnormal operands and results are (signed) zeros. The CPU's
// switches (x86's MXCSR DAZ and FTZ, Arm's FPCR.FZ) do it for float64 too, which a GPU
// does not; gpukv's kernels meet no float64 subnormals that this would change.
#if defined(__x86_64__) || defined(__i386__)
using FloatControl = uint32_t;
FloatControl float_control() {
    uint32_t mxcsr;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    return mxcsr;
}
void set_float_control(FloatControl mxcsr) { asm volatile("ldmxcsr %0" : : "m"(mxcsr)); }
constexpr uint32_t kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;
FloatControl with_flush_to_zero(FloatControl c) { return c | kFlushToZero | kDenormalsAreZero; }
#elif defined(__aarch64__)
using FloatControl = uint64_t;
FloatControl float_control() {
    uint64_t fpcr;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    return fpcr;
}
void set_float_control(FloatControl fpcr) { asm volatile("msr fpcr, %0" : : "r"(fpcr)); }
FloatControl with_flush_to_zero(FloatControl c) { return c | (1ull << 24); }  // FPCR.FZ
#else  // elsewhere subnormals stay as they are
using FloatControl = int;
FloatControl float_control() { return 0; }
void set_float_control(FloatControl) {}
FloatControl with_flush_to_zero(FloatControl c) { return c; }
#endif

}  // namespace

// ---------------------------------------------------------------------- the API
EXPORT void gpukv_emu_run(const gpukv_emu_config* config, void (*thread)(void*), void* closure,
                          gpukv_emu_result* result) {
    memset(result, 0, sizeof *result);
    g_result = result;
    g_thread = thread;
    g_closure = closure;
    g_fibers_mode = config->fibers != 0;
    gpukv_emu_gridDim = dim3(config->grid[0], config->grid[1], config->grid[2]);
    gpukv_emu_blockDim = dim3(config->block[0], config->block[1], config->block[2]);
    if (config->shared_mem > sizeof gpukv_emu_dynamic_shared ||
        config->block[0] * config->block[1] * config->block[2] > (unsigned)kMaxThreads) {
        result->status = GPUKV_EMU_INTERNAL;
        message("launch configuration beyond the emulation's limits");
        return;
    }
    if (g_fibers_mode && !make_stacks()) {
        result->status = GPUKV_EMU_INTERNAL;
        message("cannot map fiber stacks: %s", strerror(errno));
        return;
    }
    install_handlers();
    const FloatControl saved = float_control();
    if (config->ftz) set_float_control(with_flush_to_zero(saved));
    if (sigsetjmp(g_escape, 1) == 0) {
        g_owner = pthread_self();
        g_armed = 1;
        run_grid(config);
        g_armed = 0;
    } else {
        result->status = g_escape_status;
    }
    set_float_control(saved);  // also after a fault: siglongjmp restores no float state
    restore_handlers();
    g_current = nullptr;
}

EXPORT int gpukv_emu_barrier(int line, int predicate) {
    if (!g_fibers_mode) {
        // kernels.py picks fiber mode for every library that calls this function, so
        // only a library that reached it by other means (dlsym, a pointer) gets here.
        if (gpukv_emu_blockDim.x * gpukv_emu_blockDim.y * gpukv_emu_blockDim.z == 1)
            return predicate;
        record_position();
        g_result->line = line;
        message("__syncthreads() on line %d was reached in a launch not run as fibers", line);
        escape(GPUKV_EMU_INTERNAL);
    }
    Fiber* f = g_current;
    f->state = WAITING;
    f->line = line;
    f->predicate = predicate;
    switch_to_scheduler(f);
    return g_barrier_value;
}

EXPORT void gpukv_emu_trap(const char* what, const char* file, int line) {
    record_position();
    g_result->line = line;
    message("%s on line %d", what, line);
    (void)file;
    escape(GPUKV_EMU_TRAP);
}

EXPORT uint64_t gpukv_emu_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
