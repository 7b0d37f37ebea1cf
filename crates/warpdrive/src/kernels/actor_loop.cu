// The resident actor loop (actor/gpu_loop.rs generates the rest: each actor's handler in a
// namespace, then `actor_dispatch`). One 32-thread block per actor; thread 0 runs the
// handlers in order, the whole warp reads and writes the rings.
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
#define MAX_TRACED 256  // MAX_BATCH: with trace_every 1 every message is recorded

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
__device__ __forceinline__ void ll_load(const u64* p, u32& d0, u32& f0, u32& d1, u32& f1) {
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
                 : "l"(p)
                 : "memory");
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

// Writes `n` staged outputs (sw u32 each) to a ring from sequence `seq`, whole warp.
__device__ __forceinline__ void write_window(u64* ring, u64 cap, u32 sw, u64 seq, u32 n,
                                             const u32* stage) {
    const u32 lane = threadIdx.x & 31u;
    const u32 vps = sw / 2;
    for (u32 i = lane; i < n * vps; i += 32) {
        const u32 k = i / vps, v = i % vps;
        const u64 s = seq + k;
        u64* p = ring + (s & (cap - 1)) * sw + 2 * v;
        ll_store(p, stage[k * sw + 2 * v], stage[k * sw + 2 * v + 1], ll_flag(s));
    }
    __syncwarp();
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
    const u64 trace_every = d[D_TRACE_EVERY];
    u64* trace = blk + d[D_TRACE_BASE];
    const u32 ranks = lanes + (dev_ring ? 1u : 0u);
    const u32 in_vps = in_sw / 2;

    extern __shared__ __align__(16) u32 smem[];
    u32* in_stage = smem;                                // ranks x wmax slots of in_sw
    u32* out_stage = smem + (u64)d[D_IN_STAGE];          // pick_max slots of out_sw
    __shared__ u32 st[MAX_RANKS][MAX_WINDOW];
    __shared__ u32 win[MAX_RANKS];
    __shared__ u64 head[MAX_RANKS];
    __shared__ u32 ctl[3];  // terminate, run, parked
    __shared__ u32 n_out, n_picks;
    __shared__ u64 state_dummy;
    void* state = d[D_STATE] ? (void*)d[D_STATE] : (void*)&state_dummy;

    // Thread 0's bookkeeping.
    u64 out_tail = 0, out_head = 0, fwd_tail = 0, handled = 0, dropped = 0, busy = 0;
    u64 host_beat = 0, beat_time = 0, loops = 0, park_ns = 0, dropped_shown = 0;
    u32 since_lower = 0, status = 2, parked = 0;
    u64 cal_seen = 0, traced = 0;
    // Thread 0's sampled messages of this iteration: (correlation | lane << 32, start).
    u64 tr_id[MAX_TRACED], tr_start[MAX_TRACED];
    u32 n_tr = 0;
    if (lane == 0) {
        for (u32 r = 0; r < ranks; ++r) {
            head[r] = r < lanes ? ld_word(blk + C_IN_HEAD + (lanes - 1 - r)) : ld_word(dev_ring);
            win[r] = 1;
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
    }
    __syncwarp();

    for (;;) {
        __syncwarp();  // every lane has read the last iteration's ctl before lane 0 rewrites it
        if (lane == 0) {
            const u64 cmd = ld_word(sysw + S_COMMAND);
            const u64 beat = ld_word(sysw + S_HOST_BEAT);
            const u32 act = (u32)(ld_word(blk + C_COMMAND) & 1);
            const u64 t = now_ns();
            if (beat != host_beat) {
                host_beat = beat;
                beat_time = t;
                if (parked) {
                    parked = 0;
                    if (a == 0) st_word(sysw + S_PARKED, 0);
                }
            } else if (!parked && t - beat_time > park_ns) {
                parked = 1;
                if (a == 0) st_word(sysw + S_PARKED, 1);
            }
            if (act != status) {
                status = act;
                st_word(blk + C_STATUS, act);
            }
            ++loops;
            if (a == 0) st_word(sysw + S_LOOP_BEAT, loops);
            if (a == 0 && (loops & 63) == 0) {
                // A clock calibration asked by the host: the time first, then the answer.
                const u64 req = ld_word(sysw + S_CAL_REQ);
                if (req != cal_seen) {
                    cal_seen = req;
                    st_word(sysw + S_CAL_NS, now_ns());
                    __threadfence_system();
                    st_word(sysw + S_CAL_ACK, req);
                }
            }
            if ((loops & 255) == 0) st_word(blk + C_LOOPS, loops);
            ctl[0] = cmd == 1;
            ctl[1] = act && !parked;
            ctl[2] = parked;
        }
        __syncwarp();
        if (ctl[0]) break;
        if (!ctl[1]) {
            __nanosleep(ctl[2] ? 100000 : 2000);
            continue;
        }
        const u64 t_start = now_ns();

        // Read every rank's window in one pass: all loads in flight together.
        u32 total = 0;
        for (u32 r = 0; r < ranks; ++r) {
            for (u32 k = lane; k < win[r]; k += 32) st[r][k] = 0;
            total += win[r] * in_vps;
        }
        __syncwarp();
        for (u32 i = lane; i < total; i += 32) {
            u32 r = 0, local = i;
            while (local >= win[r] * in_vps) {
                local -= win[r] * in_vps;
                ++r;
            }
            const u32 k = local / in_vps, v = local % in_vps;
            const u64 s = head[r] + k;
            const u64* ring;
            u64 rcap;
            if (r < lanes) {
                ring = blk + d[D_LANE_BASE + (lanes - 1 - r)];
                rcap = cap;
            } else {
                ring = dev_ring + DEV_RING_SLOTS;
                rcap = dev_cap;
            }
            u32 d0, f0, d1, f1;
            ll_load(ring + (s & (rcap - 1)) * in_sw + 2 * v, d0, f0, d1, f1);
            const u32 want = ll_flag(s);
            const u32 c = ll_cmp(f0, want) | ll_cmp(f1, want);
            if (c) atomicOr(&st[r][k], c);
            u32* stage = in_stage + ((u64)r * wmax + k) * in_sw;
            stage[2 * v] = d0;
            stage[2 * v + 1] = d1;
        }
        __syncwarp();

        u32 picks = 0;
        if (lane == 0) {
            u32 count[MAX_RANKS], pos[MAX_RANKS];
            bool full[MAX_RANKS];
            for (u32 r = 0; r < ranks; ++r) {
                u32 n = 0;
                while (n < win[r] && (st[r][n] == 0 || st[r][n] == 2)) ++n;
                count[r] = n;
                pos[r] = 0;
                full[r] = n == win[r];  // more may wait beyond the window
                win[r] = full[r] ? min(win[r] * 2, wmax) : (n == 0 ? 1 : win[r]);
            }
            u64 room;
            if (fwd_ring) {
                room = fwd_cap - (fwd_tail - ld_word(fwd_ring));
            } else {
                if (cap - (out_tail - out_head) < batch) out_head = ld_word(blk + C_OUT_HEAD);
                room = cap - (out_tail - out_head);
            }
            const u32 limit = (u32)min((u64)min(batch, pick_max), room);
            const u64 now = now_ns();
            u32 outs = 0;
            for (;;) {
                for (u32 r = 0; r < ranks; ++r) {
                    while (pos[r] < count[r] && st[r][pos[r]] == 2) {
                        ++pos[r];
                        ++dropped;
                    }
                }
                if (picks >= limit) break;
                // The highest rank with messages, or with a full window used up (its next
                // messages come first next iteration); then the next lower rank with some.
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
                const u32* in = in_stage + ((u64)r * wmax + pos[r]) * in_sw;
                ++pos[r];
                u32* out = out_stage + (u64)outs * out_sw;
                for (u32 j = 2; j < out_sw; ++j) out[j] = 0;
                ActorCtx ctx;
                ctx.actor = a;
                ctx.lane = r < lanes ? lanes - 1 - r : 0;
                ctx.correlation = in[0];
                ctx.reply = 1;
                ctx.seq = handled;
                ctx.now_ns = now;
                if (trace_every && handled % trace_every == 0 && n_tr < MAX_TRACED) {
                    tr_id[n_tr] = (u64)in[0] | (u64)ctx.lane << 32;
                    tr_start[n_tr] = now_ns();
                    ++n_tr;
                }
                actor_dispatch(kind, in + 2, out + 2, state, &ctx);
                ++handled;
                ++picks;
                if (ctx.reply) {
                    out[0] = in[0];
                    out[1] = 0;
                    ++outs;
                }
            }
            n_out = outs;
            for (u32 r = 0; r < ranks; ++r) {
                if (!pos[r]) continue;
                head[r] += pos[r];
                if (r < lanes) st_word(blk + C_IN_HEAD + (lanes - 1 - r), head[r]);
                else st_word(dev_ring, head[r]);
            }
            n_picks = picks;
        }
        __syncwarp();
        picks = n_picks;
        const u32 outs = n_out;
        if (outs) {
            if (fwd_ring) {
                write_window(fwd_ring + DEV_RING_SLOTS, fwd_cap, out_sw, __shfl_sync(0xffffffffu, fwd_tail, 0),
                             outs, out_stage);
            } else {
                write_window(blk + d[D_OUTBOX_BASE], cap, out_sw, __shfl_sync(0xffffffffu, out_tail, 0), outs,
                             out_stage);
            }
        }
        if (lane == 0 && n_tr) {
            const u64 done = now_ns();
            for (u32 k = 0; k < n_tr; ++k) {
                u64* rec = trace + ((traced + k) & (TRACE_SLOTS - 1)) * TRACE_WORDS;
                st_word(rec, tr_id[k]);
                st_word(rec + 1, t_start);
                st_word(rec + 2, tr_start[k]);
                st_word(rec + 3, done);
            }
            traced += n_tr;
            n_tr = 0;
            __threadfence_system();  // the records before the tail that shows them
            st_word(blk + C_TRACE_TAIL, traced);
        }
        if (lane == 0 && picks) {
            if (fwd_ring) {
                fwd_tail += outs;
                st_word(blk + C_FORWARDED, fwd_tail);
            } else {
                out_tail += outs;
                st_word(blk + C_OUT_TAIL, out_tail);
            }
            busy += now_ns() - t_start;
            st_word(blk + C_PROCESSED, handled);
            st_word(blk + C_BUSY_NS, busy);
        }
        if (lane == 0 && dropped != dropped_shown) {
            dropped_shown = dropped;
            st_word(blk + C_DROPPED, dropped);
        }
        __syncwarp();
    }
    if (lane == 0) {
        st_word(blk + C_LOOPS, loops);
        st_word(blk + C_STATUS, 0);
    }
}
