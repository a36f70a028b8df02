// A kernel that stops with a device trap: the fault-injection test hook
// (CudaBackend::inject_trap_for_test) records it into an executable's
// replayed graphs to check what a kernel fault inside replay does. No
// schedule ever launches it.
#include "common.cuh"

struct TrapP { i64 when; };

extern "C" __global__ void trap_always(const TrapP p) {
    if (p.when >= 0) {
        __trap();
    }
}
