//! The actor tests' messages, handlers and waits (tests/actor.rs, tests/actor_api.rs): a
//! 64-byte message in and out, a stateful handler in CUDA C and as a closure that must agree,
//! and a stateless echo.

use std::time::{Duration, Instant};

use bytemuck::{Pod, Zeroable};
use warpdrive::actor::{Actor, ActorCtx, ActorSpec};

/// 64 bytes in: an id, a value, and how long the handler should stay busy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct In {
    pub id: u32,
    pub value: u32,
    pub busy_ns: u32,
    pub pad: [u32; 13],
}

/// 64 bytes out: the id, 3·value + 1, how many messages the actor had handled before, the
/// lane.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Out {
    pub id: u32,
    pub value: u32,
    pub seen: u64,
    pub lane: u32,
    pub pad: [u32; 11],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable, PartialEq)]
pub struct State {
    pub count: u64,
    pub sum: u64,
}

pub const CUDA: &str = r#"
struct In { u32 id; u32 value; u32 busy_ns; u32 pad[13]; };
struct Out { u32 id; u32 value; u64 seen; u32 lane; u32 pad[11]; };
struct State { u64 count; u64 sum; };
__device__ void handle(const In* in, Out* out, State* s, ActorCtx* ctx) {
    if (in->busy_ns) {
        u64 t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < in->busy_ns);
    }
    out->id = in->id;
    out->value = in->value * 3u + 1u;
    out->seen = s->count;
    out->lane = ctx->lane;
    s->count += 1;
    s->sum += in->value;
}
"#;

pub fn host(i: &In, o: &mut Out, s: &mut State, ctx: &mut ActorCtx) {
    if i.busy_ns > 0 {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_nanos(i.busy_ns as u64) {
            std::hint::spin_loop();
        }
    }
    o.id = i.id;
    o.value = i.value.wrapping_mul(3).wrapping_add(1);
    o.seen = s.count;
    o.lane = ctx.lane;
    s.count += 1;
    s.sum += i.value as u64;
}

pub fn spec(name: &str) -> ActorSpec<In, Out, State> {
    ActorSpec::new(name, State::default()).cuda(CUDA).host(host)
}

pub fn msg(id: u32, value: u32) -> In {
    In {
        id,
        value,
        busy_ns: 0,
        pad: [0x5a5a_5a5a; 13],
    }
}

pub const WAIT: Duration = Duration::from_secs(10);

/// The actor's stats once it has counted `processed` messages (and `dropped` dropped), or
/// after `WAIT`: the loop publishes its counts just after its replies.
pub fn settled(a: &Actor<In, Out>, processed: u64, dropped: u64) -> warpdrive::actor::ActorStats {
    let t0 = Instant::now();
    loop {
        let s = a.stats();
        if (s.processed >= processed && s.dropped >= dropped) || t0.elapsed() > WAIT {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A stateless echo (`S = ()`): on CUDA its handlers run one message per thread.
pub fn stateless(name: &str) -> ActorSpec<In, Out, ()> {
    ActorSpec::new(name, ())
        .cuda(
            "struct In { u32 id; u32 value; u32 busy_ns; u32 pad[13]; };\n\
             struct Out { u32 id; u32 value; u64 seen; u32 lane; u32 pad[11]; };\n\
             struct State {};\n\
             __device__ void handle(const In* in, Out* out, State*, ActorCtx* ctx) {\n\
             out->id = in->id; out->value = in->value * 3u + 1u; out->seen = ctx->seq;\n\
             out->lane = ctx->lane; ctx->reply = in->id % 3 != 0; }",
        )
        .host(|i: &In, o: &mut Out, _: &mut (), ctx: &mut ActorCtx| {
            o.id = i.id;
            o.value = i.value.wrapping_mul(3).wrapping_add(1);
            o.seen = ctx.seq;
            o.lane = ctx.lane;
            ctx.reply = u32::from(i.id % 3 != 0);
        })
}
