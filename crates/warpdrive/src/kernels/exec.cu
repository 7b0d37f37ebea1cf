// archs: sm_75 sm_80 sm_90 sm_90a
// Kernels of the exec floor's tests.

// Executes a trap: the context gets a sticky fault (the recovery test's device loss).
// Any block size; launched as 1 block of 32.
extern "C" __global__ void __launch_bounds__(32) trap_kernel() { __trap(); }
