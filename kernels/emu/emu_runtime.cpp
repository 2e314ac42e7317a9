// emu_runtime.cpp: runs the kernels compiled against cuda_emu.h (read its opening comment first).
// Here: the kernel registry, fiber stacks and the context switch, the per-block scheduler with its
// barriers, warp collectives and deadlock diagnosis, the helper threads that share a launch's
// blocks, and the C ABI that Rust calls.

// build.rs force-includes cuda_emu.h into this unit as well; its __noinline__ macro would break
// libstdc++'s own __attribute__((__noinline__)), and this file does not need it.
#undef __noinline__

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <exception>
#include <memory>
#include <numeric>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include "cuda_emu.h"

namespace pt_emu {
namespace {

// ---- kernels -----------------------------------------------------------------------------------
struct Kernel {
    std::string name;
    void (*launch)(void** params);
    unsigned max_threads;  // its __launch_bounds__; 0: none
};

// Filled by the registrars while the library loads, read-only afterwards.
std::vector<Kernel>& kernels() {
    static std::vector<Kernel> all;
    return all;
}

const Kernel* find_kernel(const char* name) {
    for (const Kernel& k : kernels())
        if (k.name == name) return &k;
    return nullptr;
}

// ---- fiber stacks ------------------------------------------------------------------------------
// A fiber needs its locals (three wmma fragments are ~2 KiB, mma_sync uses 2 KiB more) and what
// AddressSanitizer adds around them.
#if defined(__SANITIZE_ADDRESS__)
constexpr std::size_t stack_bytes = 256 * 1024;
#else
constexpr std::size_t stack_bytes = 64 * 1024;
#endif

struct Stack {
    void* base;  // lowest usable address
    std::size_t size;
};

// The fiber stacks of one OS thread, allocated as blocks need them and kept until the thread
// ends. Each sits above an inaccessible page, so an overflow faults instead of corrupting.
class StackPool {
public:
    StackPool() = default;
    StackPool(const StackPool&) = delete;
    StackPool& operator=(const StackPool&) = delete;
    ~StackPool() {
        for (void* m : maps_) munmap(m, guard() + stack_bytes);
    }

    // Makes stacks 0..n-1 exist; false if the memory is not there.
    bool reserve(std::size_t n) {
        while (maps_.size() < n) {
            void* m = mmap(nullptr, guard() + stack_bytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
            if (m == MAP_FAILED) return false;
            if (mprotect(m, guard(), PROT_NONE) != 0) {
                munmap(m, guard() + stack_bytes);
                return false;
            }
            maps_.push_back(m);
        }
        return true;
    }
    Stack operator[](std::size_t i) const { return {static_cast<char*>(maps_[i]) + guard(), stack_bytes}; }

private:
    static std::size_t guard() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }
    std::vector<void*> maps_;
};

// ---- context switch ----------------------------------------------------------------------------
// Kernels switch fibers millions of times and swapcontext makes a system call per switch, so on
// x86-64 a switch saves what the SysV ABI has callees preserve (rbx, rbp, r12-r15, the MXCSR and
// x87 control words) on the old stack, swaps stack pointers and restores the same from the new one.
// Loading a control word stalls the pipeline, and kernels never change them, so each is loaded
// only when it differs from the one in effect.
#if defined(__x86_64__)
extern "C" __attribute__((visibility("hidden"))) void pt_emu_switch_stack(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .globl pt_emu_switch_stack
    .hidden pt_emu_switch_stack
    .type pt_emu_switch_stack, @function
pt_emu_switch_stack:
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
    movl (%rsp), %eax
    movzwl 4(%rsp), %ecx
    movq %rsi, %rsp
    cmpl (%rsp), %eax
    je 1f
    ldmxcsr (%rsp)
1:
    cmpw 4(%rsp), %cx
    je 2f
    fldcw 4(%rsp)
2:
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size pt_emu_switch_stack, .-pt_emu_switch_stack
)");

struct Context {
    void* sp = nullptr;
};

// A context that starts `entry` (which must never return) on `stack` at the first switch to it:
// the frame pt_emu_switch_stack pops, with `entry` as its return address.
void make_context(Context& c, Stack stack, void (*entry)()) {
    auto* top = reinterpret_cast<std::uintptr_t*>(static_cast<char*>(stack.base) + stack.size);
    std::uintptr_t* frame = top - 9;
    std::uint32_t mxcsr;
    std::uint16_t fpu_control;
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(fpu_control));
    frame[0] = mxcsr | std::uintptr_t{fpu_control} << 32;
    std::fill(frame + 1, frame + 7, 0);                // r15 r14 r13 r12 rbx rbp
    frame[7] = reinterpret_cast<std::uintptr_t>(entry);  // where `ret` goes: rsp ≡ 8 (mod 16) there, as after a call
    frame[8] = 0;                                       // entry's return address: none, ending backtraces
    c.sp = frame;
}
void switch_context(Context& from, const Context& to) { pt_emu_switch_stack(&from.sp, to.sp); }
#else
struct Context {
    ucontext_t uc;
};
void make_context(Context& c, Stack stack, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack.base;
    c.uc.uc_stack.ss_size = stack.size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
void switch_context(Context& from, const Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// ---- the launch, as every OS thread working on it sees it --------------------------------------
struct Launch {
    const Kernel* kernel;
    dim3 grid, block;
    unsigned shared_bytes;
    unsigned long long seed;
    void** params;
    unsigned long long blocks;

    std::atomic<unsigned long long> next_block{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex{};
    std::string error{};  // the first failure

    // Guarded by the helper pool's mutex: helpers still wanted, and helpers working on it.
    unsigned seats = 0, aboard = 0;

    void run_blocks();
    void record_failure(const std::string& message);

    // The block the launch runs `n`-th: the identity for seed 0, else the permutation
    // i = (stride·n + offset) mod blocks, with the stride drawn from the seed and coprime to
    // the count (every block runs once), so blocks that depend on another's running first
    // (a GPU gives no order) show up for some seed.
    unsigned long long block_at(unsigned long long n) const {
        if (seed == 0 || blocks < 2) return n;
        return (unsigned long long)(((unsigned __int128)stride * n + offset) % blocks);
    }
    unsigned long long stride = 1, offset = 0;
    void draw_block_order() {
        if (seed == 0 || blocks < 2) return;
        unsigned long long h = seed * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
        offset = h % blocks;
        stride = 1 + (h >> 7) % (blocks - 1);
        while (std::gcd(stride, blocks) != 1) stride = stride % (blocks - 1) + 1;
    }
};

// ---- formatting --------------------------------------------------------------------------------
std::string vformat(const char* format, va_list args) {
    va_list again;
    va_copy(again, args);
    const int n = std::vsnprintf(nullptr, 0, format, args);
    std::string s(n > 0 ? std::size_t(n) : 0, '\0');
    std::vsnprintf(s.data(), s.size() + 1, format, again);
    va_end(again);
    return s;
}
std::string format(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* format, ...) {
    va_list args;
    va_start(args, format);
    std::string s = vformat(format, args);
    va_end(args);
    return s;
}

const char* collective_name(Collective op) {
    switch (op) {
        case Collective::syncwarp: return "__syncwarp";
        case Collective::shfl: return "__shfl_sync";
        case Collective::shfl_up: return "__shfl_up_sync";
        case Collective::shfl_down: return "__shfl_down_sync";
        case Collective::shfl_xor: return "__shfl_xor_sync";
        case Collective::ballot: return "__ballot_sync";
        case Collective::any: return "__any_sync";
        case Collective::all: return "__all_sync";
        case Collective::wmma_load: return "wmma::load_matrix_sync";
        case Collective::wmma_store: return "wmma::store_matrix_sync";
        case Collective::wmma_mma: return "wmma::mma_sync";
    }
    return "a warp collective";
}

// splitmix64's finaliser: seeds per block, and the draws that pick the next fiber.
unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// ---- the block scheduler -----------------------------------------------------------------------
enum class State : unsigned char { ready, at_barrier, at_warp, exited };

struct Fiber {
    Context context;
    Stack stack;
    uint3 idx;
    unsigned linear;  // x + bx·(y + by·z): lane = linear % 32, warp = linear / 32
    State state;
    // While at a warp collective: which one, the lanes it waits for, the posted value and source lane.
    Collective op;
    unsigned mask;
    unsigned long long value;
    int src_lane;
    WarpResult result;  // written by the lane that completes the collective
};

// A warp collective that lanes are arriving at.
struct Gathering {
    unsigned mask;     // the lanes it waits for
    Collective op;
    unsigned arrived;  // the lanes that have arrived
};

struct Warp {
    unsigned lanes;   // lanes that exist
    unsigned exited;  // lanes that have returned
    // Each gathering holds at least one waiting lane, so a warp has at most 32 at once.
    unsigned gathering_count;
    Gathering gathering[32];
};

// Runnable fibers, in a ring. Each is queued at most once, so the block's thread count bounds
// the size; the capacity is a power of two so that wrapping is a mask, not a division.
class ReadyQueue {
public:
    void reset(std::size_t threads) {
        std::size_t capacity = 1;
        while (capacity < threads) capacity *= 2;
        slots_.resize(capacity);
        head_ = size_ = 0;
    }
    std::size_t size() const { return size_; }
    void push(unsigned short fiber) { slots_[(head_ + size_++) & (slots_.size() - 1)] = fiber; }
    // Removes and returns the k-th queued fiber (0: the one queued longest).
    unsigned short take(std::size_t k) {
        const std::size_t wrap = slots_.size() - 1;
        std::swap(slots_[(head_ + k) & wrap], slots_[head_]);
        const unsigned short fiber = slots_[head_];
        head_ = (head_ + 1) & wrap;
        --size_;
        return fiber;
    }

private:
    std::vector<unsigned short> slots_;
    std::size_t head_ = 0, size_ = 0;
};

[[noreturn]] void fiber_main();

// Runs the blocks given to one OS thread, one at a time.
class Block {
public:
    Block();
    // Runs block `index` of `launch` to its end; false with error() set if it failed.
    bool run(const Launch& launch, unsigned long long index, void* dynamic_shared);
    const std::string& error() const { return error_; }

    // Called by the running fiber.
    void sync_block();
    WarpResult warp_collective(Collective op, unsigned mask, unsigned long long value, int src_lane);
    unsigned live_lanes() const;
    void poison_shared(void* p, std::size_t bytes);
    [[noreturn]] void fail(std::string message);
    [[noreturn]] void run_kernel();

private:
    Fiber* next_fiber();
    void pass_on(Context& from, bool exiting);
    void suspend() { pass_on(running_->context, false); }
    void make_ready(Fiber& f);
    void release_warp(unsigned first_fiber, unsigned mask);
    std::string thread_name(unsigned linear) const;
    std::string describe_stuck_threads() const;

    const Launch* launch_ = nullptr;
    std::vector<Fiber> fibers_;
    std::vector<Warp> warps_;
    ReadyQueue ready_;
    unsigned long long rng_ = 0;
    unsigned at_barrier_ = 0, exited_ = 0;
    Fiber* running_ = nullptr;
    Context scheduler_;
    std::string error_;
    StackPool stacks_;
    std::vector<void*> poisoned_;  // the static shared variables this block has filled
#if defined(__SANITIZE_ADDRESS__)
    void* os_stack_bottom_ = nullptr;  // where the scheduler runs, for switches back to it
    std::size_t os_stack_size_ = 0;
#endif
};

Block::Block() {
#if defined(__SANITIZE_ADDRESS__)
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
        pthread_attr_getstack(&attr, &os_stack_bottom_, &os_stack_size_);
        pthread_attr_destroy(&attr);
    }
#endif
}

// The Block of this OS thread, for the calls from its fibers: a plain pointer, because a
// thread_local object costs an initialisation check on every barrier and collective.
thread_local Block* running_block = nullptr;
Block& this_thread_block() { return *running_block; }

// Creates this OS thread's Block at its first launch; it lives, with its fiber stacks, as long as the thread.
Block& block_for_launch() {
    static thread_local std::unique_ptr<Block> block;
    if (!block) {
        block = std::make_unique<Block>();
        running_block = block.get();
    }
    return *block;
}

bool Block::run(const Launch& launch, unsigned long long index, void* dynamic_shared) {
    const dim3 b = launch.block, g = launch.grid;
    const unsigned n = b.x * b.y * b.z;
    launch_ = &launch;
    error_.clear();
    if (!stacks_.reserve(n)) {
        error_ = format("kernel %s: cannot map %u fiber stacks", launch.kernel->name.c_str(), n);
        return false;
    }
    current.block_idx = {unsigned(index % g.x), unsigned(index / g.x % g.y), unsigned(index / g.x / g.y)};
    current.block_dim = b;
    current.grid_dim = g;
    current.dynamic_shared = dynamic_shared;
    std::memset(dynamic_shared, 0xFF, launch.shared_bytes);
    poisoned_.clear();

    fibers_.resize(n);
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = fibers_[i];
        f = Fiber{};
        f.idx = {i % b.x, i / b.x % b.y, i / b.x / b.y};
        f.linear = i;
        f.stack = stacks_[i];
        make_context(f.context, f.stack, fiber_main);
    }
    warps_.assign((n + 31) / 32, Warp{~0u, 0, 0, {}});
    if (n % 32 != 0) warps_.back().lanes = (1u << n % 32) - 1;
    at_barrier_ = exited_ = 0;
    ready_.reset(n);
    for (Fiber& f : fibers_) make_ready(f);

    rng_ = mix64(launch.seed ^ mix64(index + 0x9E3779B97F4A7C15ull));
    // Fibers hand the OS thread to one another; it comes back here when none can run.
    pass_on(scheduler_, false);
    if (error_.empty() && exited_ < n) error_ = describe_stuck_threads();
    if (error_.empty()) return true;

    error_ = format("kernel %s, block (%u,%u,%u): ", launch.kernel->name.c_str(), current.block_idx.x,
                    current.block_idx.y, current.block_idx.z) + error_;
#if defined(__SANITIZE_ADDRESS__)
    // The abandoned fibers' frames leave their redzones poisoned; the next block reuses the stacks.
    for (const Fiber& f : fibers_) __asan_unpoison_memory_region(f.stack.base, f.stack.size);
#endif
    return false;
}

// The fiber to run next: none once the block has failed or when every fiber waits or has ended.
Fiber* Block::next_fiber() {
    if (!error_.empty() || ready_.size() == 0) return nullptr;
    std::size_t k = 0;
    if (launch_->seed != 0) {
        rng_ += 0x9E3779B97F4A7C15ull;
        k = std::size_t((unsigned __int128)mix64(rng_) * ready_.size() >> 64);  // uniform below size()
    }
    return &fibers_[ready_.take(k)];
}

// Gives the OS thread from `from` (the scheduler's context or the running fiber's) to the next
// fiber, or to the scheduler if there is none: one switch per resume rather than two through the
// scheduler. Returns when `from` is resumed; never, for an `exiting` fiber.
void Block::pass_on(Context& from, bool exiting) {
    Fiber* const next = next_fiber();
    Context& to = next != nullptr ? next->context : scheduler_;
    if (&to == &from) return;  // the fiber that just waited is the one drawn to run
    running_ = next;
    if (next != nullptr) {
        current.thread_idx = next->idx;
        current.lane = next->linear % 32;
    }
#if defined(__SANITIZE_ADDRESS__)
    // An exiting fiber's frames are never unwound: clear their redzones, as for a longjmp, before
    // the next block starts a fiber on this stack.
    if (exiting) __asan_handle_no_return();
    // `from`'s stack-use-after-return frames are kept while it is switched out, freed if it exits.
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(exiting ? nullptr : &fake_stack, next ? next->stack.base : os_stack_bottom_,
                                   next ? next->stack.size : os_stack_size_);
    switch_context(from, to);
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
    (void)exiting;
    switch_context(from, to);
#endif
}

// Every fiber starts here. C++ exceptions must not unwind past it: there is nothing above.
[[noreturn]] void Block::run_kernel() {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    bool threw = false;
    try {
        launch_->kernel->launch(launch_->params);
    } catch (...) {
        threw = true;  // fail outside the handler, which would otherwise never be left
    }
    if (threw) fail("the kernel threw a C++ exception");

    Fiber& f = *running_;
    f.state = State::exited;
    ++exited_;
    warps_[f.linear / 32].exited |= 1u << f.linear % 32;
    pass_on(f.context, true);
    __builtin_unreachable();  // an exited fiber is never resumed
}

[[noreturn]] void fiber_main() { this_thread_block().run_kernel(); }

[[noreturn]] void Block::fail(std::string message) {
    error_ = "thread " + thread_name(running_->linear) + ": " + message;
    // Nothing on an abandoned fiber's stack is ever destroyed: free the message's memory now.
    { const std::string gone = std::move(message); }
    pass_on(running_->context, true);  // no fiber runs after an error: back to the scheduler
    __builtin_unreachable();
}

void Block::make_ready(Fiber& f) {
    f.state = State::ready;
    ready_.push(static_cast<unsigned short>(&f - fibers_.data()));
}

void Block::sync_block() {
    running_->state = State::at_barrier;
    // All threads, not all live ones: a thread that has returned can never arrive.
    if (++at_barrier_ == fibers_.size()) {
        at_barrier_ = 0;
        for (Fiber& f : fibers_) make_ready(f);
    }
    suspend();
}

WarpResult Block::warp_collective(Collective op, unsigned mask, unsigned long long value, int src_lane) {
    Fiber& f = *running_;
    const unsigned lane = f.linear % 32, first_fiber = f.linear - lane;
    Warp& w = warps_[f.linear / 32];
    mask &= w.lanes;  // lanes past the end of a partial warp do not exist
    if ((mask >> lane & 1) == 0)
        fail(format("%s with mask 0x%08x, which leaves out the calling lane %u", collective_name(op), mask, lane));

    // Lanes meet at the collective with the same mask. Masks of collectives being gathered may
    // overlap (lanes 0-15 at a __syncwarp while lanes 16-31 finish a shuffle of their own), but
    // two different collectives with one mask mean the lanes disagree about what comes next.
    Gathering* const end = w.gathering + w.gathering_count;
    Gathering* g = std::find_if(w.gathering, end, [&](const Gathering& e) { return e.mask == mask; });
    if (g == end) {
        *g = {mask, op, 0};
        ++w.gathering_count;
    } else if (g->op != op) {
        fail(format("%s with mask 0x%08x while lanes 0x%08x wait at %s with the same mask", collective_name(op), mask,
                    g->arrived, collective_name(g->op)));
    }
    g->arrived |= 1u << lane;
    f.state = State::at_warp;
    f.op = op;
    f.mask = mask;
    f.value = value;
    f.src_lane = src_lane;
    if (g->arrived == mask) {
        release_warp(first_fiber, mask);
        *g = w.gathering[--w.gathering_count];
    }
    suspend();
    return f.result;
}

// The last lane of `mask` has arrived: every participant gets its result and becomes runnable.
void Block::release_warp(unsigned first_fiber, unsigned mask) {
    unsigned ballot = 0;
    for (unsigned lane = 0; lane < 32; ++lane)
        if ((mask >> lane & 1) != 0 && fibers_[first_fiber + lane].value != 0) ballot |= 1u << lane;
    for (unsigned lane = 0; lane < 32; ++lane) {
        if ((mask >> lane & 1) == 0) continue;
        Fiber& f = fibers_[first_fiber + lane];
        const int src = f.src_lane;
        // A source lane that takes no part gives an undefined value on the GPU: all ones here.
        const bool defined = src >= 0 && (mask >> src & 1) != 0;
        f.result = {defined ? fibers_[first_fiber + src].value : ~0ull, ballot, mask};
        make_ready(f);
    }
}

unsigned Block::live_lanes() const {
    const Warp& w = warps_[running_->linear / 32];
    return w.lanes & ~w.exited;
}

// A kernel declares few static shared variables: a linear search is the cheapest set.
void Block::poison_shared(void* p, std::size_t bytes) {
    if (std::find(poisoned_.begin(), poisoned_.end(), p) != poisoned_.end()) return;
    std::memset(p, 0xFF, bytes);
    poisoned_.push_back(p);
}

std::string Block::thread_name(unsigned linear) const {
    const Fiber& f = fibers_[linear];
    if (launch_->block.y == 1 && launch_->block.z == 1) return std::to_string(f.idx.x);
    return format("(%u,%u,%u)", f.idx.x, f.idx.y, f.idx.z);
}

// No fiber can run and some have not finished: says what each of them waits for, e.g.
// "__syncthreads can never complete; threads waiting at __syncthreads: 0-31; threads that exited: 32-63".
std::string Block::describe_stuck_threads() const {
    // Threads grouped by what they do, groups in order of their first thread.
    std::vector<std::pair<std::string, std::vector<unsigned>>> groups;
    bool barrier = false;
    for (const Fiber& f : fibers_) {
        std::string what;
        switch (f.state) {
            case State::at_barrier: what = "waiting at __syncthreads", barrier = true; break;
            case State::at_warp: what = format("waiting at %s with mask 0x%08x", collective_name(f.op), f.mask); break;
            case State::exited: what = "that exited"; break;
            case State::ready: what = "runnable"; break;  // cannot happen: the queue is empty
        }
        auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == what; });
        if (g == groups.end()) g = groups.insert(groups.end(), {what, {}});
        g->second.push_back(f.linear);
    }
    std::string text = barrier ? "__syncthreads can never complete" : "a warp collective can never complete";
    for (const auto& [what, threads] : groups) {
        // Consecutive threads as ranges, at most 8 of them (the message must stay short).
        text += "; threads " + what + ": ";
        std::size_t ranges = 0, i = 0;
        for (; i < threads.size() && ranges < 8; ++ranges) {
            std::size_t j = i;
            while (j + 1 < threads.size() && threads[j + 1] == threads[j] + 1) ++j;
            text += (ranges ? ", " : "") + thread_name(threads[i]) + (j > i ? "-" + thread_name(threads[j]) : "");
            i = j + 1;
        }
        if (i < threads.size()) text += ", ...";
    }
    return text;
}

// ---- launches over OS threads ------------------------------------------------------------------
// One launch's dynamic shared memory on one OS thread: exactly the launch's bytes, so that
// AddressSanitizer reports an access past the end. 128-byte aligned, so wmma tiles at any
// 32-byte multiple offset are aligned as on the GPU.
class DynamicShared {
public:
    explicit DynamicShared(std::size_t bytes) : p_(::operator new(bytes, alignment)) {}
    DynamicShared(const DynamicShared&) = delete;
    DynamicShared& operator=(const DynamicShared&) = delete;
    ~DynamicShared() { ::operator delete(p_, alignment); }
    void* get() const { return p_; }

private:
    static constexpr std::align_val_t alignment{128};
    void* p_;
};

void Launch::record_failure(const std::string& message) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (error.empty()) error = message;
    failed = true;
}

// Takes blocks until none is left or one has failed. Runs on the launching thread and on helpers.
void Launch::run_blocks() {
    try {
        DynamicShared shared(shared_bytes);
        Block& block = block_for_launch();
        while (!failed) {
            const unsigned long long n = next_block++;
            if (n >= blocks) break;
            const unsigned long long i = block_at(n);
            if (!block.run(*this, i, shared.get())) record_failure(block.error());
        }
    } catch (const std::exception& e) {
        record_failure(format("kernel %s: %s", kernel->name.c_str(), e.what()));
    }
}

// OS threads that join launches spread over more than one. They are started as launches first
// ask for them and live as long as the library, so their fiber stacks are reused.
class Helpers {
public:
    // While it lives, up to `n` helpers work on `launch`; its end waits until they have left.
    class Offer {
    public:
        Offer(Launch& launch, unsigned n) : launch_(launch), n_(n) {
            if (n_ > 0) helpers().open(launch, n);
        }
        Offer(const Offer&) = delete;
        Offer& operator=(const Offer&) = delete;
        ~Offer() {
            if (n_ > 0) helpers().close(launch_);
        }

    private:
        Launch& launch_;
        unsigned n_;
    };

    ~Helpers() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        work_.notify_all();
        for (std::thread& t : threads_) t.join();
    }

private:
    static Helpers& helpers() {
        static Helpers pool;
        return pool;
    }

    void open(Launch& launch, unsigned n) {
        std::unique_lock<std::mutex> lock(mutex_);
        while (threads_.size() < n) threads_.emplace_back([this] { serve(); });
        open_.push_back(&launch);  // after everything that may throw: ~Offer does not run then
        launch.seats = n;
        lock.unlock();
        work_.notify_all();
    }

    void close(Launch& launch) {
        std::unique_lock<std::mutex> lock(mutex_);
        open_.erase(std::remove(open_.begin(), open_.end(), &launch), open_.end());
        left_.wait(lock, [&] { return launch.aboard == 0; });
    }

    void serve() {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            work_.wait(lock, [&] { return stopping_ || !open_.empty(); });
            if (stopping_) return;
            Launch& launch = *open_.front();
            if (--launch.seats == 0) open_.erase(open_.begin());
            ++launch.aboard;
            lock.unlock();
            launch.run_blocks();
            lock.lock();
            if (--launch.aboard == 0) left_.notify_all();
        }
    }

    std::mutex mutex_;
    std::condition_variable work_, left_;
    std::vector<std::thread> threads_;
    std::vector<Launch*> open_;  // launches that still take helpers
    bool stopping_ = false;
};

// Why the GPU would refuse this launch configuration, or "".
std::string check_configuration(const Kernel& kernel, dim3 g, dim3 b, unsigned shared_bytes) {
    constexpr unsigned max_shared = 227 * 1024;
    if (g.x == 0 || g.y == 0 || g.z == 0 || b.x == 0 || b.y == 0 || b.z == 0)
        return format("grid (%u,%u,%u) or block (%u,%u,%u) has a zero dimension", g.x, g.y, g.z, b.x, b.y, b.z);
    if (b.x > 1024 || b.y > 1024 || b.z > 64 || b.x * b.y * b.z > 1024)
        return format("block (%u,%u,%u) has more than 1024 threads or exceeds (1024,1024,64)", b.x, b.y, b.z);
    if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535)
        return format("grid (%u,%u,%u) exceeds (2^31-1,65535,65535)", g.x, g.y, g.z);
    if (shared_bytes > max_shared)
        return format("%u bytes of dynamic shared memory; at most %u (227 KiB)", shared_bytes, max_shared);
    if (kernel.max_threads != 0 && b.x * b.y * b.z > kernel.max_threads)
        return format("block (%u,%u,%u) has %u threads, more than its __launch_bounds__(%u)", b.x, b.y, b.z,
                      b.x * b.y * b.z, kernel.max_threads);
    return "";
}

}  // namespace

// ---- what cuda_emu.h declares ------------------------------------------------------------------
void sync_block() { this_thread_block().sync_block(); }
WarpResult warp_collective(Collective op, unsigned mask, unsigned long long value, int src_lane) {
    return this_thread_block().warp_collective(op, mask, value, src_lane);
}
unsigned live_lanes() { return this_thread_block().live_lanes(); }
void poison_shared(void* p, std::size_t bytes) { this_thread_block().poison_shared(p, bytes); }
void fail(const char* format, ...) {
    va_list args;
    va_start(args, format);
    std::string message = vformat(format, args);
    va_end(args);
    this_thread_block().fail(std::move(message));
}
void register_kernel(const char* name, void (*launch)(void**), unsigned max_threads) {
    kernels().push_back({name, launch, max_threads});
}

}  // namespace pt_emu

// ---- the C ABI ---------------------------------------------------------------------------------
// Returns 0, or writes a message into `err` and returns 1 for a launch the GPU would refuse
// (unknown kernel, bad configuration) and 2 for a kernel that failed while running.
// `threads` OS threads (at least one) share the launch's blocks.
extern "C" int pt_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned shared_bytes, unsigned long long seed, unsigned threads_wanted,
                             void** params, char* err, size_t err_len) {
    using namespace pt_emu;
    const auto report = [&](int rc, const std::string& message) {
        if (err != nullptr && err_len > 0) std::snprintf(err, err_len, "%s", message.c_str());
        return rc;
    };
    try {
        const Kernel* kernel = find_kernel(name);
        if (kernel == nullptr)
            return report(1, format("unknown kernel \"%s\" (%zu kernels are registered)", name, kernels().size()));
        const dim3 grid(gx, gy, gz), block(bx, by, bz);
        if (std::string problem = check_configuration(*kernel, grid, block, shared_bytes); !problem.empty())
            return report(1, "kernel " + kernel->name + ": " + problem);

        Launch launch{kernel, grid, block, shared_bytes, seed, params, 1ull * gx * gy * gz};
        launch.draw_block_order();
        const unsigned threads = unsigned(std::min<unsigned long long>(std::max(threads_wanted, 1u), launch.blocks));
        {
            Helpers::Offer offer(launch, threads - 1);
            launch.run_blocks();
        }
        return launch.failed ? report(2, launch.error) : 0;
    } catch (const std::exception& e) {
        return report(2, std::string("cuda-emu: ") + e.what());
    }
}

extern "C" size_t pt_emu_kernel_count(void) { return pt_emu::kernels().size(); }

extern "C" const char* pt_emu_kernel_name(size_t i) {
    return i < pt_emu::kernels().size() ? pt_emu::kernels()[i].name.c_str() : nullptr;
}

