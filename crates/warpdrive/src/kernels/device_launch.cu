// archs: sm_80 sm_90
// links: cudadevrt
// Work launched from the device (exec::DeviceGraph, exec::Dispatcher). Compiled relocatable
// (-rdc) and linked with the CUDA device runtime (libcudadevrt.a) by the driver's linker:
// cudaGraphLaunch and cudaGetCurrentGraphExec below are the device runtime's.
//
// Clock: %globaltimer (ns, one clock for every SM), so a stamp on one SM and a stamp on
// another compare.

__device__ __forceinline__ u64 dl_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// What a dispatcher's launches share with the host, zeroed before each run.
struct DispatchState {
    u32 count;     // requests in the queue
    u32 head;      // requests taken so far
    u32 round;     // executions of the dispatcher graph so far
    u32 fired;     // graphs launched so far
    int status;    // the first failing cudaGraphLaunch's error (0: none)
};

// The first kernel of every device-launchable graph warpdrive captures: stamps when the graph
// started, in the slot its launcher wrote to `slot` before launching it (the stamps are the
// decision-to-start latency). `starts` holds `capacity` stamps; a slot past it is dropped.
extern "C" __global__ void __launch_bounds__(32) dl_started(
    u64* __restrict__ starts, const u32* __restrict__ slot, u32 capacity) {
    if (threadIdx.x == 0) {
        const u64 now = dl_now();  // before the slot's load, which is not part of the start
        const u32 i = *(volatile const u32*)slot;
        if (i < capacity) starts[i] = now;
    }
}

// The decision half of the latency probe: stamps its decision in `decided[i]` (i = *slot),
// publishes i as the slot of the work it starts, then launches `child` from the device, fire
// and forget or (`tail`) as the tail launch, which starts when this kernel's graph ends.
// Runs inside a graph (graph launches from the device come only from graph kernels).
// `returned[i]` stamps when the launch call returned (the rest, to the child's start, is the
// device's scheduling).
extern "C" __global__ void __launch_bounds__(32) dl_fire_one(
    cudaGraphExec_t child, u32* __restrict__ slot, u64* __restrict__ decided,
    u64* __restrict__ returned, int* __restrict__ status, u32 capacity, u32 tail) {
    if (threadIdx.x != 0) return;
    const u32 i = *(volatile u32*)slot + 1;
    if (i < capacity) decided[i] = dl_now();
    *(volatile u32*)slot = i;
    __threadfence();
    const cudaError_t e =
        cudaGraphLaunch(child, tail ? cudaStreamGraphTailLaunch : cudaStreamGraphFireAndForget);
    if (i < capacity) returned[i] = dl_now();
    if (e != cudaSuccess && *status == 0) *status = (int)e;
}

// The probe's floor: as dl_fire_one, but launches the stamping kernel itself (a device-side
// kernel launch into the fire-and-forget stream) instead of a graph.
extern "C" __global__ void __launch_bounds__(32) dl_fire_kernel(
    u32* __restrict__ slot, u64* __restrict__ decided, u64* __restrict__ starts,
    int* __restrict__ status, u32 capacity) {
    if (threadIdx.x != 0) return;
    const u32 i = *(volatile u32*)slot + 1;
    if (i < capacity) decided[i] = dl_now();
    *(volatile u32*)slot = i;
    __threadfence();
    dl_started<<<1, 32, 0, cudaStreamFireAndForget>>>(starts, slot, capacity);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess && *status == 0) *status = (int)e;
}

// The decision half of the host-side probes: stamps and publishes the slot as dl_fire_one
// does, and, when `flag` is not null, writes the slot to it (mapped host memory: the host
// waits for it, then launches the work itself: the round trip).
extern "C" __global__ void __launch_bounds__(32) dl_decide(
    u32* __restrict__ slot, u64* __restrict__ decided, volatile u32* flag, u32 capacity) {
    if (threadIdx.x != 0) return;
    const u32 i = *(volatile u32*)slot + 1;
    if (i < capacity) decided[i] = dl_now();
    *(volatile u32*)slot = i;
    __threadfence_system();
    if (flag != nullptr) *flag = i;
}

// The bucket of `value`: the first i with value <= bounds[i], else the last bucket.
__device__ __forceinline__ u32 dl_bucket(u32 value, const u32* __restrict__ bounds, u32 buckets) {
    for (u32 b = 0; b + 1 < buckets; ++b)
        if (value <= bounds[b]) return b;
    return buckets - 1;
}

// Records the decision for request `head` (target b, round) and writes the request's index to
// the target's slot word (its dl_started kernel stamps that entry), then launches the target
// as `how` says. A failed launch stops the run (head = count) with its error.
__device__ __forceinline__ bool dl_launch(u32 head, u32 b, u32 round,
                                          const cudaGraphExec_t* __restrict__ targets,
                                          cudaStream_t how, DispatchState* state,
                                          u32* slots, u32* decisions, u64* decided) {
    decisions[head] = b | (round << 8);
    decided[head] = dl_now();
    *(volatile u32*)&slots[b] = head;
    __threadfence();
    const cudaError_t e = cudaGraphLaunch(targets[b], how);
    if (e != cudaSuccess) {
        if (state->status == 0) state->status = (int)e;
        state->head = state->count;
        return false;
    }
    state->fired += 1;
    return true;
}

// The dispatcher with several requests a round: one execution takes requests in order and
// launches each one's target (fire and forget) until `per_round` of them, a target already
// launched in this round (a graph cannot run twice at once), or the end of the queue. Then,
// while requests remain, it launches itself as its own tail: the next round starts when this
// one and everything it launched have finished. No host work between rounds.
//
// requests[state->count]: the values to route; bounds[buckets]: each bucket's upper bound;
// targets[buckets]: the device-launchable graphs; decisions[count]: target | round << 8;
// decided[count]: decision times; slots[buckets]: each target's slot word (a target runs at
// most once a round, so its slot cannot be overwritten before it reads it).
extern "C" __global__ void __launch_bounds__(32) dl_dispatch(
    const u32* __restrict__ requests, const u32* __restrict__ bounds,
    const cudaGraphExec_t* __restrict__ targets, u32 buckets, u32 per_round,
    DispatchState* __restrict__ state, u32* __restrict__ slots, u32* __restrict__ decisions,
    u64* __restrict__ decided) {
    if (threadIdx.x != 0) return;
    const u32 count = state->count;
    const u32 round = state->round;
    u32 head = state->head;
    // Bit b set: bucket b launched this round (buckets <= 64, checked by the host).
    u64 launched = 0;
    u32 taken = 0;
    while (head < count && taken < per_round) {
        const u32 b = dl_bucket(requests[head], bounds, buckets);
        if (launched & (1ull << b)) break;
        launched |= 1ull << b;
        if (!dl_launch(head, b, round, targets, cudaStreamGraphFireAndForget, state, slots,
                       decisions, decided))
            return;
        ++head;
        ++taken;
    }
    state->head = head;
    state->round = round + 1;
    if (head < count) {
        const cudaError_t e = cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
        if (e != cudaSuccess && state->status == 0) state->status = (int)e;
    }
}

// The dispatcher with one request a round, chained: the last kernel of every target (and the
// whole of the graph that starts a run) takes the next request and launches its target as the
// tail launch of the graph it runs in, which starts when that graph ends. One launch a
// request, and no dispatcher graph between targets. Arguments as dl_dispatch's.
extern "C" __global__ void __launch_bounds__(32) dl_chain(
    const u32* __restrict__ requests, const u32* __restrict__ bounds,
    const cudaGraphExec_t* __restrict__ targets, u32 buckets,
    DispatchState* __restrict__ state, u32* __restrict__ slots, u32* __restrict__ decisions,
    u64* __restrict__ decided) {
    if (threadIdx.x != 0) return;
    const u32 head = state->head;
    if (head >= state->count) return;
    const u32 b = dl_bucket(requests[head], bounds, buckets);
    const u32 round = state->round;
    state->head = head + 1;
    state->round = round + 1;
    dl_launch(head, b, round, targets, cudaStreamGraphTailLaunch, state, slots, decisions,
              decided);
}
