// The resident actor loop (actor/gpu_loop.rs generates the rest: each actor's handler in a
// namespace, then `actor_dispatch`). One 32-thread block per actor; the whole warp reads and
// writes the rings; thread 0 picks the messages in priority order (an actor with one lane
// and nothing dropped takes its first messages in order, known to every lane, and answers
// them before any bookkeeping, a lone message as soon as its read returns); an iteration's
// books run while the next read is in flight; the handlers of an actor without state run one
// message per thread, those of an actor with state on thread 0 in order (its state sees the
// messages one at a time, as on the CPU backend).
//
// Ring format (actor/ring.rs): 64-bit words, payload in the low half, flag `seq | 1` in the
// high half; a slot is `sw` words, its payload an 8-byte header (correlation id, lane) and
// the message. Readers load 16 bytes (two words) at a time and accept a slot when every
// flag is the one expected; a slot whose flags are all a later lap's was overwritten.

struct ActorCtx {
    u32 actor;
    u32 lane;
    u32 correlation;
    u32 reply;
    u64 seq;
    u64 now_ns;
};

__device__ void actor_dispatch(u32 kind, const void* in, void* out, void* state, ActorCtx* ctx);

// Descriptor words (actor/gpu_loop.rs writes the same indices).
#define D_BLOCK 0
#define D_STATE 1
#define D_DEV_RING 2
#define D_FWD_RING 3
#define D_LANES 4
#define D_CAPACITY 5
#define D_IN_SW 6
#define D_OUT_SW 7
#define D_BATCH 8
#define D_STARVATION 9
#define D_KIND 10
#define D_OUTBOX_BASE 11
#define D_FWD_CAPACITY 12
#define D_DEV_CAPACITY 13
#define D_WMAX 14
#define D_PICK_MAX 15
#define D_LANE_BASE 16
#define D_SYS 20
#define D_IN_STAGE 21
#define D_TRACE_BASE 22
#define D_TRACE_EVERY 23
#define D_PARALLEL 24
#define D_QUICK_STREAM 25
#define D_WIDE 26
#define D_TAIL_HINT 27
#define D_WORDS 32

// Control words (actor/ring.rs `ctrl` and `sys`).
#define C_COMMAND 0
#define C_STATUS 1
#define C_OUT_HEAD 2
#define C_IN_HEAD 3
#define C_PROCESSED 9
#define C_DROPPED 10
#define C_BUSY_NS 12
#define C_LOOPS 13
#define C_OUT_TAIL 14
#define C_FORWARDED 15
#define C_CLOCK_START 16
#define C_TRACE_TAIL 17
#define C_PHASE_NS 18  // N_PHASES words
#define N_PHASES 5
#define C_GAP_NS 23
#define C_GAP_READS 24  // hits, misses
#define C_WINDOW_SLOTS 26  // the first rank's window summed over iterations, busy iterations
#define C_TAIL_HINT 28     // lane l's claimed tail at C_TAIL_HINT + l (ActorSpec::tail_hint)
#define S_COMMAND 0
#define S_HOST_BEAT 1
#define S_PARK_NS 2
#define S_LOOP_BEAT 3
#define S_PARKED 4
#define S_CAL_REQ 6
#define S_CAL_ACK 7
#define S_CAL_NS 8
// Sampled message records: TRACE_SLOTS of TRACE_WORDS words (actor/ring.rs).
#define TRACE_SLOTS 1024
#define TRACE_WORDS 4
#define MAX_BATCH 256

#define MAX_RANKS 5
#define MAX_WINDOW 256
// A device ring's head word, then its slots from word 2 (16-byte aligned).
#define DEV_RING_SLOTS 2

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ u64 ld_word(const u64* p) {
    u64 v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_word(u64* p, u64 v) {
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// No memory clobber: a window's loads go out back to back, each waited for at its first use.
__device__ __forceinline__ void ll_load(const u64* p, u32& d0, u32& f0, u32& d1, u32& f1) {
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
                 : "l"(p));
}
__device__ __forceinline__ void ll_store(u64* p, u32 d0, u32 d1, u32 f) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(d0), "r"(f), "r"(d1),
                 "r"(f)
                 : "memory");
}
__device__ __forceinline__ u32 ll_flag(u64 seq) { return (u32)seq | 1u; }
// 0: the flag expected; 1: an older lap (not written yet); 2: a later lap (overwritten).
__device__ __forceinline__ u32 ll_cmp(u32 got, u32 want) {
    int d = (int)(got - want);
    return d == 0 ? 0u : (d < 0 ? 1u : 2u);
}

// Writes the `n` staged outputs `order[0..n)` (sw u32 each; `order` null: `0..n`) to a ring
// from sequence `seq`, whole warp.
__device__ __forceinline__ void write_window(u64* ring, u64 cap, u32 sw, u64 seq, u32 n,
                                             const u32* stage, const u16* order) {
    const u32 lane = threadIdx.x & 31u;
    const u32 vps = sw / 2;
    if (n == 1 && !order) {
        // One answer (a closed-loop client's): a vector a lane, no division, no order.
        u64* slot = ring + (seq & (cap - 1)) * sw;
        for (u32 v = lane; v < vps; v += 32) ll_store(slot + 2 * v, stage[2 * v], stage[2 * v + 1], ll_flag(seq));
        __syncwarp();
        return;
    }
    for (u32 i = lane; i < n * vps; i += 32) {
        const u32 k = i / vps, v = i % vps;
        const u64 s = seq + k;
        const u32* src = stage + (u64)(order ? order[k] : k) * sw + 2 * v;
        u64* p = ring + (s & (cap - 1)) * sw + 2 * v;
        ll_store(p, src[0], src[1], ll_flag(s));
    }
    __syncwarp();
}

#define MAX_PUBLISH 32
// Clears the slot states of every rank's next window (all threads).
#define CLEAR_ST()                                                          \
    do {                                                                    \
        for (u32 r_ = 0; r_ < ranks; ++r_)                                  \
            for (u32 k_ = lane; k_ < win[r_]; k_ += 32) st[r_][k_] = 0;     \
    } while (0)
// Thread 0 queues a word to publish; `flush` stores the queue, all threads at once.
#define PUBLISH(p, v)            \
    do {                         \
        pub_at[n_pub] = (p);     \
        pub_val[n_pub] = (v);    \
        ++n_pub;                 \
    } while (0)
#define FLUSH()                                                   \
    do {                                                          \
        __syncwarp();                                             \
        if (lane < n_pub) st_word(pub_at[lane], pub_val[lane]);   \
        __syncwarp();                                             \
        if (lane == 0) n_pub = 0;                                 \
        __syncwarp();                                             \
    } while (0)

// A rank's next window: twice as wide after a full one (more may wait beyond it), the
// smallest (two slots: one more than a lone message, so its iteration sees the ring drained)
// after an empty one.
__device__ __forceinline__ u32 next_window(u32 win, u32 ready, u32 wmin, u32 wmax) {
    return ready == win ? min(win * 2, wmax) : (ready == 0 ? wmin : win);
}

#ifdef ACTOR_TAIL_HINT
// The window a rank's claimed tail asks for beyond `head` (0: none claimed beyond it). Only a
// size: a slot claimed but not yet written reads as not written.
__device__ __forceinline__ u32 hinted(u64 tail, u64 head, u32 wmax) {
    return tail > head ? (u32)min(tail - head, (u64)wmax) : 0u;
}
#endif

// The gap after answering every message seen before the next read (ns): a closed-loop
// client is still writing its next request (a read now would miss it, and the next read
// comes a round trip later). It starts at one read's round trip (`READ_RT_NS` until one is
// measured), shrinks by GAP_DOWN each time the read after it finds a message and grows by
// GAP_UP when that read finds none and the one after it does (a miss): about one read in
// GAP_UP / GAP_DOWN + 1 after a gap misses (1 in 13; a miss costs its message one read,
// p50 none, and misses the gap cannot prevent — a host's slow reaction — must stay under
// that share or they hold the gap at its cap).
#define READ_RT_NS 1500
#define GAP_DOWN 8
#define GAP_UP 96

// Loads in flight per thread while reading the windows (each a PCIe round trip to host
// memory); the loop that issues them is unrolled, so they stay in registers.
#define LOADS_IN_FLIGHT 16
// Vectors read in one round of three loads a lane (actor/gpu_loop.rs sizes windows by it).
#define ONE_TRIP_VECTORS 96

// What reading the windows needs: the flat order of the ranks' windows (`pre`), the rings,
// and where the slot states and the staged slots go.
struct RingView {
    const u32* pre;
    u32 ranks;
    const u64* head;
    const u64* const* rbase;
    const u64* rmask;
    u32 in_sw, in_vps, wmax;
    u32* st;  // [MAX_RANKS][MAX_WINDOW]
    u32* in_stage;
};

// Reads vectors `base + j * 32 + lane` (j < N) of the windows' flat order: all N loads go out,
// then the control word (`ctl_at`, when `with_ctl`: a load before them made ptxas wait for it
// at their first branch, a second round trip) and, with the tail hint, the lane's claimed tail
// (`hint_at`, null for lanes without one: a load of its own, so the lone answer, which needs
// only the control word, does not wait for the hint's line), then `between` runs (when
// `call`: the last iteration's books, while the loads are in flight), then each slot's state
// and payload.
// `stop` and `drop` take the first slot (of rank 0 when it is the only one) with a vector the
// lane saw not written yet, and overwritten: a lone rank's count by a reduction, in
// registers. Slot states with a bit of `mark` go to `st` (a lone rank read in one trip needs
// only the overwritten ones, for the priority picker; no shared atomics when none is).
template <u32 N, class F>
__device__ __forceinline__ void read_chunk(const RingView& rv, u32 base, u32 total, u32 lane,
                                           bool with_ctl, const u64* ctl_at, u64& word,
                                           const u64* hint_at, u64& hint_word, u32& stop, u32& drop,
                                           u32 mark, bool call, F&& between) {
    u32 v0[N], f0[N], v1[N], f1[N], at[N], want[N];
#pragma unroll
    for (u32 j = 0; j < N; ++j) {
        const u32 i = base + j * 32 + lane;
        at[j] = ~0u;
        if (i < total) {
            u32 r = 0, first = 0;
#pragma unroll
            for (u32 q = 1; q < MAX_RANKS; ++q) {
                if (q < rv.ranks && i >= rv.pre[q]) {
                    r = q;
                    first = rv.pre[q];
                }
            }
            const u32 local = i - first;
            const u32 k = local / rv.in_vps, v = local - k * rv.in_vps;
            const u64 sq = rv.head[r] + k;
            ll_load(rv.rbase[r] + (sq & rv.rmask[r]) * rv.in_sw + 2 * v, v0[j], f0[j], v1[j], f1[j]);
            at[j] = r << 24 | k << 8 | v;
            want[j] = ll_flag(sq);
        }
    }
    if (with_ctl) word = ld_word(ctl_at);
#ifdef ACTOR_TAIL_HINT
    if (with_ctl && hint_at) hint_word = ld_word(hint_at);
#endif
    if (call) between();
#pragma unroll
    for (u32 j = 0; j < N; ++j) {
        if (at[j] == ~0u) continue;
        const u32 r = at[j] >> 24, k = (at[j] >> 8) & 0xffffu, v = at[j] & 0xffu;
        const u32 c = ll_cmp(f0[j], want[j]) | ll_cmp(f1[j], want[j]);
        if (c & mark) atomicOr(&rv.st[r * MAX_WINDOW + k], c);
        if (c & 1u) stop = min(stop, k);
        if (c & 2u) drop = min(drop, k);
        u32* stage = rv.in_stage + ((u64)r * rv.wmax + k) * rv.in_sw;
        stage[2 * v] = v0[j];
        stage[2 * v + 1] = v1[j];
    }
}

// The loop: one block of 32 threads per actor, `n_actors` blocks (a cooperative launch, so
// all are resident at once and a pipeline of actors cannot wait on one not running).
extern "C" __global__ void __launch_bounds__(32) actor_loop(const u64* __restrict__ descs,
                                                            u32 n_actors) {
    const u32 a = blockIdx.x;
    if (a >= n_actors) return;
    const u32 lane = threadIdx.x & 31u;
    const u64* d = descs + (u64)a * D_WORDS;
    u64* blk = (u64*)d[D_BLOCK];
    u64* sysw = (u64*)d[D_SYS];
    u64* dev_ring = (u64*)d[D_DEV_RING];
    u64* fwd_ring = (u64*)d[D_FWD_RING];
    const u32 lanes = (u32)d[D_LANES], in_sw = (u32)d[D_IN_SW], out_sw = (u32)d[D_OUT_SW];
    const u64 cap = d[D_CAPACITY], dev_cap = d[D_DEV_CAPACITY], fwd_cap = d[D_FWD_CAPACITY];
    const u32 batch = (u32)d[D_BATCH], starvation = (u32)d[D_STARVATION], kind = (u32)d[D_KIND];
    const u32 wmax = (u32)d[D_WMAX], pick_max = (u32)d[D_PICK_MAX];
    // The window after an empty read: two slots; with ActorSpec::wide_window, after an
    // iteration of a lone rank that took a stream (more than two messages), as many as one
    // round of loads reads (d[D_WIDE], actor/gpu_loop.rs), so the stream's next burst is
    // read at once, and two again after a lone message, so a closed-loop client's read
    // stays short.
    u32 wmin = min(2u, wmax);
    const u64 trace_every = d[D_TRACE_EVERY];
    const bool parallel = d[D_PARALLEL] != 0;
    // A lone rank read in several chunks (a stream's window) counted in registers too, as a
    // one-trip read is (ActorSpec::quick_stream; off: the slot states and ballots). Compiled
    // in only where an actor asks (actor/gpu_loop.rs): the flag alone makes the loop spill at
    // its 255 registers (sm_90).
#ifdef ACTOR_QUICK_STREAM
    const bool quick_stream = d[D_QUICK_STREAM] != 0;
#else
    const bool quick_stream = false;
#endif
    u64* trace = blk + d[D_TRACE_BASE];
    u64* outbox = blk + d[D_OUTBOX_BASE];
    const u32 ranks = lanes + (dev_ring ? 1u : 0u);
    const u32 in_vps = in_sw / 2;

    extern __shared__ __align__(16) u32 smem[];
    u32* in_stage = smem;                                // ranks x wmax slots of in_sw
    u32* out_stage = smem + (u64)d[D_IN_STAGE];          // pick_max slots of out_sw
    __shared__ u32 st[MAX_RANKS][MAX_WINDOW];
    __shared__ u32 win[MAX_RANKS];
    __shared__ u64 head[MAX_RANKS];
    __shared__ u32 n_picks;  // thread 0's picks, and bit 31 when they were every message seen
    __shared__ const u64* rbase[MAX_RANKS];  // each rank's ring: slots from here
    __shared__ u64 rmask[MAX_RANKS];         // its capacity - 1
    __shared__ u32 cnt[MAX_RANKS];           // messages ready (thread 0 picks among them)
    __shared__ u32 pick[MAX_BATCH];          // (rank << 16) | position in the rank's window
    // Words to publish at the end of the iteration, one per thread in a single store: a
    // thread's stores to host memory one after another cost a round trip each.
    __shared__ u64* pub_at[MAX_PUBLISH];
    __shared__ u64 pub_val[MAX_PUBLISH];
    __shared__ u32 n_pub;
    __shared__ u8 replied[MAX_BATCH];
    __shared__ u16 order[MAX_BATCH];    // the picks that replied, in pick order
    __shared__ u64 state_dummy;
    // Lane 0's counts (C_WINDOW_SLOTS): the first rank's window summed over iterations, and
    // the iterations that took messages. In shared memory: the loop has no registers to spare.
    __shared__ u64 counts[2];
#ifdef ACTOR_TAIL_HINT
    // Each rank's claimed tail as the last control load found it (0: no hint; a device
    // ring's rank has none), for lane 0's windows. Compiled in only where an actor asks
    // (actor/gpu_loop.rs); off for an actor, its tails stay 0.
    __shared__ u64 tails[MAX_RANKS];
#endif
    void* state = d[D_STATE] ? (void*)d[D_STATE] : (void*)&state_dummy;

    // Thread 0's bookkeeping.
    u64 out_tail = 0, out_head = 0, fwd_tail = 0, handled = 0, dropped = 0, busy = 0;
    u64 host_beat = 0, beat_time = 0, loops = 0, park_ns = 0, dropped_shown = 0;
    u32 since_lower = 0, status = 2, parked = 0;
    u64 cal_seen = 0, traced = 0;
    u64 phase[N_PHASES] = {0, 0, 0, 0, 0};  // read, control, pick, answer, after (ns)
    if (lane == 0) {
        for (u32 r = 0; r < ranks; ++r) {
            head[r] = r < lanes ? ld_word(blk + C_IN_HEAD + (lanes - 1 - r)) : ld_word(dev_ring);
            win[r] = wmin;
            rbase[r] = r < lanes ? blk + d[D_LANE_BASE + (lanes - 1 - r)] : dev_ring + DEV_RING_SLOTS;
            rmask[r] = (r < lanes ? cap : dev_cap) - 1;
        }
        out_tail = ld_word(blk + C_OUT_TAIL);
        out_head = ld_word(blk + C_OUT_HEAD);
        fwd_tail = ld_word(blk + C_FORWARDED);
        handled = ld_word(blk + C_PROCESSED);
        dropped = ld_word(blk + C_DROPPED);
        park_ns = ld_word(sysw + S_PARK_NS);
        host_beat = ld_word(sysw + S_HOST_BEAT);
        beat_time = now_ns();
        st_word(blk + C_CLOCK_START, beat_time);
        n_pub = 0;
        counts[0] = counts[1] = 0;
#ifdef ACTOR_TAIL_HINT
        for (u32 r = 0; r < MAX_RANKS; ++r) tails[r] = 0;
#endif
    }
    for (u32 i = lane; i < MAX_RANKS * MAX_WINDOW; i += 32) st[i / MAX_WINDOW][i % MAX_WINDOW] = 0;
    __syncwarp();
    // Lane 0: the room for answers (the outbox or the next actor's ring), at most a batch.
    // It is taken after each iteration's answers, for the next: room only grows meanwhile
    // (the host or the next actor consumes), so nothing on the way to an answer loads it.
    auto room_limit = [&]() -> u32 {
        u64 room;
        if (fwd_ring) {
            room = fwd_cap - (fwd_tail - ld_word(fwd_ring));
        } else {
            if (cap - (out_tail - out_head) < batch) out_head = ld_word(blk + C_OUT_HEAD);
            room = cap - (out_tail - out_head);
        }
        return (u32)min((u64)min(batch, pick_max), room);
    };
    // The same in every lane: the room, and the messages handled so far (each handler's
    // `ctx.seq`).
    u32 limit = __shfl_sync(0xffffffffu, lane == 0 ? room_limit() : 0u, 0);
    handled = __shfl_sync(0xffffffffu, handled, 0);
    u64 ans_tail = __shfl_sync(0xffffffffu, fwd_ring ? fwd_tail : out_tail, 0);  // the next answer's

    // Lane 0 after every iteration: the loop's count, its beat, a clock calibration the host
    // asked for, and every 256 iterations the count and the phases.
#define BOOKS()                                                                     \
    do {                                                                            \
        ++loops;                                                                    \
        if (a == 0 && (loops & 63) == 0) {                                          \
            /* The beat every 64 iterations: an idle iteration stores nothing. */   \
            PUBLISH(sysw + S_LOOP_BEAT, loops);                                     \
            /* A calibration asked by the host: the time first, then the answer. */ \
            const u64 req = ld_word(sysw + S_CAL_REQ);                              \
            if (req != cal_seen) {                                                  \
                cal_seen = req;                                                     \
                st_word(sysw + S_CAL_NS, now_ns());                                 \
                __threadfence_system();                                             \
                st_word(sysw + S_CAL_ACK, req);                                     \
            }                                                                       \
        }                                                                           \
        if ((loops & 255) == 0) {                                                   \
            PUBLISH(blk + C_LOOPS, loops);                                          \
            PUBLISH(blk + C_GAP_NS, min(gap, read_rt));                             \
            PUBLISH(blk + C_GAP_READS, gap_hits);                                   \
            PUBLISH(blk + C_GAP_READS + 1, gap_misses);                             \
            for (u32 q = 0; q < N_PHASES; ++q) PUBLISH(blk + C_PHASE_NS + q, phase[q]); \
            for (u32 q = 0; q < 2; ++q) PUBLISH(blk + C_WINDOW_SLOTS + q, counts[q]); \
        }                                                                           \
    } while (0)

    // The control words: lane 0 the system command, lane 1 the host's beat, the others the
    // actor's command (one request for them all).
    const u64* ctl_at = lane == 0 ? sysw + S_COMMAND : lane == 1 ? sysw + S_HOST_BEAT : blk + C_COMMAND;
    // ActorSpec::tail_hint: lane 3 + l also loads lane l's claimed tail, in the same round of
    // loads as the control words (no round trip of its own).
    const u64* hint_at = nullptr;
    u64 hint_word = 0;
#ifdef ACTOR_TAIL_HINT
    if (d[D_TAIL_HINT] && lane >= 3 && lane < 3 + lanes) hint_at = blk + C_TAIL_HINT + (lane - 3);
#endif
    bool running = false;   // the last iteration's decision: handle messages
    bool answered = false;  // the last iteration answered every message it saw
    u64 word = 0, last_word = 0, gap_until = 0;
    // The gap (see GAP_UP): the gap, a plain read's round trip (its cap), and where the reads
    // after an answer are: 1 the first (after the gap), 2 the second. Every lane computes
    // them; lane 0's are the ones used (the gap's wait follows lane 0) and published.
    u64 gap = ~0ull, read_rt = READ_RT_NS, gap_hits = 0, gap_misses = 0;
    u32 probe = 0;
    // An iteration's books (counters, publication, the slot states' clearing, the room) run
    // in the next iteration while its loads are in flight: they cost ~0.6 µs of one warp's
    // instructions, which a closed-loop client's next request waited for. What they need:
    // what the iteration was (0 none, 1 idle, 2 it took messages), a plain read's round trip
    // (0: none), when its after phase began, its picks and answers.
    u32 pend = 0, p_rt = 0, p_picks = 0, p_outs = 0;
    bool p_solo = false;
    u64 p_after = 0;
    auto settle = [&](u64 t_now) {
        if (!pend) return;
        if (lane == 0) {
            phase[4] += t_now - p_after;  // an inactive loop's sleep included
            counts[0] += win[0];              // the window being read (or the next one)
            if (p_rt) read_rt = (read_rt * 7 + p_rt) / 8;
            if (pend == 2) {
                if (p_picks) ++counts[1];
                if (p_solo && p_picks) PUBLISH(lanes ? blk + C_IN_HEAD + (lanes - 1) : dev_ring, head[0]);
                if (p_picks) {
                    if (fwd_ring) {
                        fwd_tail += p_outs;
                        PUBLISH(blk + C_FORWARDED, fwd_tail);
                    } else {
                        out_tail += p_outs;
                        PUBLISH(blk + C_OUT_TAIL, out_tail);
                    }
                    PUBLISH(blk + C_PROCESSED, handled);
                    PUBLISH(blk + C_BUSY_NS, busy);
                }
                if (dropped != dropped_shown) {
                    dropped_shown = dropped;
                    PUBLISH(blk + C_DROPPED, dropped);
                }
            }
            BOOKS();
            if (pend == 2) limit = room_limit();  // for the next answers, after these
        }
        if (pend == 2) limit = __shfl_sync(0xffffffffu, limit, 0);
        __syncwarp();
        CLEAR_ST();  // for the windows being read
        FLUSH();
        pend = 0;
    };
    // Pick p's handler: its output staged (zeroed first unless `zeroed`, header after),
    // whether it replies.
    auto handle = [&](u32 p, bool solo, u64 now, bool zeroed) -> bool {
        const u32 r = solo ? 0u : pick[p] >> 16, k = solo ? p : pick[p] & 0xffffu;
        const u32* in = in_stage + ((u64)r * wmax + k) * in_sw;
        u32* out = out_stage + (u64)p * out_sw;
        // Slots are whole 16-byte vectors, so out + 2 is 8-byte aligned.
        if (!zeroed)
            for (u32 j = 2; j < out_sw; j += 2) *(u64*)(out + j) = 0;
        ActorCtx ctx;
        ctx.actor = a;
        ctx.lane = r < lanes ? lanes - 1 - r : 0;
        ctx.correlation = in[0];
        ctx.reply = 1;
        ctx.seq = handled + p;
        ctx.now_ns = now;
        actor_dispatch(kind, in + 2, out + 2, state, &ctx);
        out[0] = in[0];
        out[1] = 0;
        return ctx.reply != 0;
    };
    for (;;) {
        // Whether the last iteration ran: then this one reads the windows while the control
        // words are in flight. Nothing may wait between the first load and the last: one
        // round trip to host memory per iteration.
        const bool reading = running;
        const u64 t_start = now_ns();
        // After answering every message it saw, the gap: the reads' round trip, not the
        // loop's bookkeeping, is what the client's next request must beat.
        if (answered)
            while (__shfl_sync(0xffffffffu, now_ns() < gap_until ? 1u : 0u, 0)) {
            }
        const bool gapped = answered;
        const bool ctl_first = !reading;
        answered = false;
        auto books = [&]() { settle(t_start); };
        if (ctl_first) {
            const u64 w = ld_word(ctl_at);
            books();
            word = __shfl_sync(0xffffffffu, w, lane);
        }
        bool one_trip = false;  // one chunk: its time is one round trip
        // A lone rank's window (slots) and, per lane, its first slot not written yet and first
        // overwritten one (read_chunk).
        u32 w_solo = 0, stop = ~0u, drop = ~0u;
        if (reading) {
            // Each rank's first vector in the flat order (`st` is cleared for these windows
            // by the books, before the states are marked).
            u32 pre[MAX_RANKS + 1];
            pre[0] = 0;
#pragma unroll
            for (u32 r = 0; r < MAX_RANKS; ++r) pre[r + 1] = pre[r] + (r < ranks ? win[r] * in_vps : 0u);
            const u32 total = pre[MAX_RANKS];
            w_solo = win[0];
            // Small windows (an idle actor's: two slots of up to 256 bytes) take the chunk of
            // three loads a lane: a lone warp pays a few cycles for each instruction of the
            // sixteen-load chunk.
            const RingView rv{pre, ranks, head, rbase, rmask, in_sw, in_vps, wmax, &st[0][0], in_stage};
            one_trip = total <= ONE_TRIP_VECTORS;
            if (one_trip) {
                read_chunk<3>(rv, 0, total, lane, true, ctl_at, word, hint_at, hint_word, stop, drop,
                              ranks == 1 ? 2u : 3u, true, books);
            } else {
                const u32 mark = ranks == 1 && quick_stream ? 2u : 3u;
                for (u32 base = 0; base < total; base += 32 * LOADS_IN_FLIGHT)
                    read_chunk<LOADS_IN_FLIGHT>(rv, base, total, lane, base == 0, ctl_at, word, hint_at,
                                                hint_word, stop, drop, mark, base == 0, books);
            }
        }
        // A lone rank read in one trip (a closed-loop client's actor; with `quick_stream` in
        // any number) counts by two reductions of what each lane saw, in registers: the slot
        // states' round trip through shared memory, the ballots and their branches are for
        // the others. (Each lane's first slot not written and first overwritten are minima
        // over every chunk it read, so a multi-chunk read reduces the same way.)
        const bool quick_read = reading && ranks == 1 && (one_trip || quick_stream);
        if (quick_read) {
            stop = min(__reduce_min_sync(0xffffffffu, stop), w_solo);
            drop = __reduce_min_sync(0xffffffffu, drop);
        }
        // One message, nothing overwritten, room for its answer, and the control words as
        // the last iteration read them (it decided to run; a changed command takes the usual
        // path, a beat's absence is decided below, after this answer): the doorbell's path,
        // answered at once.
        const bool lone = quick_read && stop == 1 && drop != 0 && limit != 0 &&
                          !__any_sync(0xffffffffu, lane != 1 && word != last_word);
        const u64 t_read = now_ns();
        u32 lone_outs = 0;
        if (lone) {
            // The answer's slot zeroed by every lane, a word each (a slot holds at most 66
            // u32: an 8-byte header and 256 bytes), not by lane 0 alone.
            if (2 + 2 * lane < out_sw) *(u64*)(out_stage + 2 + 2 * lane) = 0;
            __syncwarp();  // the staged message and the zeroed answer, from every lane
            const bool yes = lane == 0 && handle(0, true, t_read, true);
            if (__ballot_sync(0xffffffffu, yes)) {
                lone_outs = 1;
                __syncwarp();  // the staged answer
                write_window(fwd_ring ? fwd_ring + DEV_RING_SLOTS : outbox, fwd_ring ? fwd_cap : cap, out_sw, ans_tail,
                             1, out_stage, nullptr);
            }
        }
        const u64 t_lone = lone ? now_ns() : t_read;  // the lone answer has left
        const u64 cmd = __shfl_sync(0xffffffffu, word, 0);
        const u64 beat = __shfl_sync(0xffffffffu, word, 1);
        const u64 act = __shfl_sync(0xffffffffu, word, 2) & 1;
        last_word = word;
#ifdef ACTOR_TAIL_HINT
        // Lane 3 + l's tail is rank lanes - 1 - l's (seen by lane 0 after the next sync).
        if (hint_at) tails[lanes + 2 - lane] = hint_word;
#endif
        // Lane 0 decides (bit 0: terminate, 1: run, 2: parked); what it publishes waits for
        // the iteration's end, after the answers.
        u32 flags = 0;
        if (lane == 0) {
            if (beat != host_beat) {
                host_beat = beat;
                beat_time = t_read;
                if (parked) {
                    parked = 0;
                    if (a == 0) PUBLISH(sysw + S_PARKED, 0);
                }
            } else if (!parked && t_read - beat_time > park_ns) {
                parked = 1;
                if (a == 0) PUBLISH(sysw + S_PARKED, 1);
            }
            if ((u32)act != status) {
                status = (u32)act;
                PUBLISH(blk + C_STATUS, act);
            }
            flags = (cmd == 1 ? 1u : 0u) | (act && !parked ? 2u : 0u) | (parked ? 4u : 0u);
        }
        flags = __shfl_sync(0xffffffffu, flags, 0);
        if ((flags & 1u) && !lone) break;
        running = (flags & 2u) != 0;
        __syncwarp();  // the windows' slot states, from every lane
        const u64 t_ctl = now_ns();
        // The iteration's picks (the same in every lane), the answers among them, the first
        // rank's window and messages ready, and whether they were every message it saw.
        u32 picks = 1, outs = lone_outs, n0 = 1, w0 = w_solo;
        bool drained = 1 < w_solo, solo = true;
        u64 t_pick = t_read, t_answer = t_lone;
        if (!lone) {
            const bool quick = running && quick_read;
            // Not running, just activated (it reads next iteration), or idle: every window the
            // smallest and its first slot not written yet (counting and picking would find
            // nothing and leave the windows alone). What was read stays in the rings (heads
            // unchanged) for when the actor runs.
            if (!running || !reading || (quick && w_solo == wmin && stop == 0) ||
                (!quick &&
                 !__any_sync(0xffffffffu, lane < ranks && (win[lane] != wmin || (st[lane][0] & 1u) == 0u)))) {
                // Nothing after the gap: a miss if the next read finds some.
                probe = probe == 1 && running ? 2u : 0u;
                phase[0] += t_read - t_start;
                phase[1] += t_ctl - t_read;
                pend = 1;
                p_rt = one_trip && !gapped ? (u32)(t_read - t_start) : 0u;
                p_after = t_ctl;
#ifdef ACTOR_TAIL_HINT
                // Messages claimed beyond an empty read (a burst written as it was read): the
                // next read takes as many (every lane reads the windows after the sync).
                if (lane < ranks) win[lane] = max(win[lane], hinted(tails[lane], head[lane], wmax));
                __syncwarp();
#endif
                if (!running) __nanosleep(flags & 4u ? 100000 : 2000);
                continue;
            }
            // Per rank: the messages ready (up to the first slot not yet written whole) and the
            // dropped among them (overwritten by a later lap), a ballot per 32 slots; the same in
            // every lane.
            u32 drops0 = 0;
            if (quick) {
                n0 = stop;
                drops0 = drop < n0 ? 1u : 0u;  // an overwritten slot before the first not written
                if (lane == 0) cnt[0] = n0;
            }
            for (u32 r = 0; r < (quick ? 0u : ranks); ++r) {
                const u32 w = win[r];
                if (r == 0) w0 = w;
                u32 n = w, drops = 0;
                for (u32 b = 0; b < w; b += 32) {
                    const u32 k = b + lane;
                    const u32 sv = k < w ? st[r][k] : 1u;
                    const u32 stop = __ballot_sync(0xffffffffu, sv & 1u);
                    u32 dm = __ballot_sync(0xffffffffu, sv == 2u);
                    if (stop) {
                        const u32 first = __ffs(stop) - 1;
                        n = b + first;
                        drops += __popc(dm & ((1u << first) - 1u));
                        break;
                    }
                    drops += __popc(dm);
                }
                if (r == 0) {
                    n0 = n;
                    drops0 = drops;
                }
                if (lane == 0) cnt[r] = n;
            }

            // One rank, nothing dropped (a lone lane's actor, the common case): the picks are its
            // first messages, in order, known to every lane; they are answered before any
            // bookkeeping, which waits for the next iteration's read.
            solo = ranks == 1 && drops0 == 0;
            if (solo) {
                picks = min(n0, limit);
                drained = n0 < w0 && picks == n0;
            } else {
                // Thread 0 picks in priority order, and moves the windows the lanes counted with.
                __syncwarp();
                if (lane == 0) {
                    u32 count[MAX_RANKS], pos[MAX_RANKS];
                    bool full[MAX_RANKS];
                    u32 np = 0;
                    for (u32 r = 0; r < ranks; ++r) {
                        const u32 n = cnt[r];
                        count[r] = n;
                        pos[r] = 0;
                        full[r] = n == win[r];  // more may wait beyond the window
                        win[r] = next_window(win[r], n, wmin, wmax);
                    }
                    for (;;) {
                        for (u32 r = 0; r < ranks; ++r) {
                            while (pos[r] < count[r] && st[r][pos[r]] == 2) {
                                ++pos[r];
                                ++dropped;
                            }
                        }
                        if (np >= limit) break;
                        // The highest rank with messages, or with a full window used up (its
                        // next messages come first next iteration); then the next lower rank
                        // with some.
                        u32 top = MAX_RANKS, lower = MAX_RANKS;
                        for (u32 r = 0; r < ranks; ++r) {
                            const bool has = pos[r] < count[r];
                            if (top == MAX_RANKS) {
                                if (has || full[r]) top = r;
                            } else if (has) {
                                lower = r;
                                break;
                            }
                        }
                        if (top == MAX_RANKS) break;
                        const bool top_has = pos[top] < count[top];
                        if (!top_has && !(lower != MAX_RANKS && since_lower >= starvation)) break;
                        u32 r = top;
                        if (lower != MAX_RANKS && since_lower >= starvation) {
                            r = lower;
                            since_lower = 0;
                        } else {
                            since_lower = lower != MAX_RANKS ? since_lower + 1 : 0;
                        }
                        pick[np++] = r << 16 | pos[r];
                        ++pos[r];
                    }
                    u32 dr = 1;
                    for (u32 r = 0; r < ranks; ++r) {
                        dr = dr && !full[r] && pos[r] == count[r];
                        if (!pos[r]) continue;
                        head[r] += pos[r];
                        PUBLISH(r < lanes ? blk + C_IN_HEAD + (lanes - 1 - r) : dev_ring, head[r]);
                    }
#ifdef ACTOR_TAIL_HINT
                    // At least the messages claimed beyond what was taken (the rules above
                    // are the floor).
                    for (u32 r = 0; r < ranks; ++r) win[r] = max(win[r], hinted(tails[r], head[r], wmax));
#endif
                    n_picks = np | dr << 31;
                }
                __syncwarp();
                picks = n_picks & 0x7fffffffu;
                drained = (n_picks >> 31) != 0;
            }
            t_pick = now_ns();

            // Handle and answer. Stateless handlers one message per thread; with state, thread 0
            // in order.
            outs = 0;
            if (picks) {
                const u16* ord = order;
                if (parallel && picks <= 32) {
                    // One message a lane: the replies by one ballot in registers; when every pick
                    // replies (the common case) they leave in pick order with no order table.
                    const bool yes = lane < picks && handle(lane, solo, t_pick, false);
                    const u32 m = __ballot_sync(0xffffffffu, yes);
                    outs = __popc(m);
                    if (m == (outs == 32 ? ~0u : (1u << outs) - 1u)) {
                        ord = nullptr;
                    } else if (yes) {
                        order[__popc(m & ((1u << lane) - 1u))] = (u16)lane;
                    }
                } else {
                    const u32 step = parallel ? 32u : 1u;
                    if (parallel || lane == 0) {
                        for (u32 p = parallel ? lane : 0u; p < picks; p += step) replied[p] = handle(p, solo, t_pick, false);
                    }
                    __syncwarp();
                    // The replies in pick order: a ballot per 32 picks.
                    for (u32 b = 0; b < picks; b += 32) {
                        const u32 p = b + lane;
                        const bool yes = p < picks && replied[p];
                        const u32 m = __ballot_sync(0xffffffffu, yes);
                        if (yes) order[outs + __popc(m & ((1u << lane) - 1u))] = (u16)p;
                        outs += __popc(m);
                    }
                }
                __syncwarp();  // the staged outputs (and order) from every lane
                if (outs) {
                    if (fwd_ring) {
                        write_window(fwd_ring + DEV_RING_SLOTS, fwd_cap, out_sw, ans_tail, outs, out_stage, ord);
                    } else {
                        write_window(outbox, cap, out_sw, ans_tail, outs, out_stage, ord);
                    }
                }
            }
            __syncwarp();  // every lane has counted with `win` before lane 0 moves it
            t_answer = now_ns();
        }
        answered = drained && picks != 0;

        // The answers have left. Before the next read: the gap, the first rank's window and
        // head; the rest of the books wait for that read's loads (`settle`).
        handled += picks;
        ans_tail += outs;
        // The gap adapts to a lone message (a closed-loop client's); after several (a
        // stream) there is none.
        gap = min(gap, read_rt);
        if (picks && probe == 1) {
            gap = gap > GAP_DOWN ? gap - GAP_DOWN : 0;
            ++gap_hits;
        }
        if (picks && probe == 2) {
            gap = min(gap + GAP_UP, read_rt);
            ++gap_misses;
        }
        probe = answered && picks == 1 ? 1u : (!picks && probe == 1 ? 2u : 0u);
        // Without the reply gap, none after a stream (near capacity a gap only lets the
        // inbox fill).
#ifdef ACTOR_REPLY_GAP
        // SystemConfig::reply_gap: after replies to the host from a stream too, the lone
        // message's gap (only if the window was drained: `answered`), so that the next read
        // samples the inbox after the client's next request could land there; without it
        // that read leaves at once, misses the request, and it waits a whole iteration more.
        // For every actor of the system (a per-actor flag made the loop spill).
        gap_until = t_answer + (picks == 1 || (!fwd_ring && outs) ? gap : 0);
#else
        gap_until = t_answer + (picks == 1 ? gap : 0);
#endif
        // Set by busy iterations only: an empty read keeps the window a stream left it.
        if (solo && picks) wmin = picks > 2 ? (u32)d[D_WIDE] : min(2u, wmax);
        if (solo && lane == 0) {
            win[0] = next_window(w0, n0, wmin, wmax);
            head[0] += picks;
#ifdef ACTOR_TAIL_HINT
            win[0] = max(win[0], hinted(tails[0], head[0], wmax));
#endif
        }
        // Sampled message records (a fence each time: off the round trip's bench).
        if (trace_every && picks && lane == 0) {
            u32 n_tr = 0;
            for (u32 p = 0; p < picks; ++p) {
                if ((handled - picks + p) % trace_every) continue;
                const u32 r = solo ? 0u : pick[p] >> 16, k = solo ? p : pick[p] & 0xffffu;
                const u32* in = in_stage + ((u64)r * wmax + k) * in_sw;
                const u64 id = (u64)in[0] | (u64)(r < lanes ? lanes - 1 - r : 0) << 32;
                u64* rec = trace + ((traced + n_tr) & (TRACE_SLOTS - 1)) * TRACE_WORDS;
                st_word(rec, id);
                st_word(rec + 1, t_start);
                st_word(rec + 2, t_pick);
                st_word(rec + 3, t_answer);
                ++n_tr;
            }
            if (n_tr) {
                traced += n_tr;
                __threadfence_system();  // the records before the tail that shows them
                st_word(blk + C_TRACE_TAIL, traced);
            }
        }
        __syncwarp();  // the window and head the next read takes
        // The phases (every lane, the same times): a lone message is read, answered, then
        // decided on (control), with no picking.
        phase[0] += t_read - t_start;
        if (lone) {
            phase[3] += t_answer - t_read;
            phase[1] += t_ctl - t_answer;
        } else {
            phase[1] += t_ctl - t_read;
            phase[2] += t_pick - t_ctl;
            phase[3] += t_answer - t_pick;
        }
        if (picks) busy += t_answer - t_start;
        pend = 2;
        p_rt = one_trip && !gapped ? (u32)(t_read - t_start) : 0u;
        p_after = lone ? t_ctl : t_answer;
        p_solo = solo;
        p_picks = picks;
        p_outs = outs;
        if (flags & 1u) break;  // after a lone answer: its books below
    }
    settle(now_ns());
    if (lane == 0) {
        st_word(blk + C_LOOPS, loops);
        st_word(blk + C_STATUS, 0);
    }
}
