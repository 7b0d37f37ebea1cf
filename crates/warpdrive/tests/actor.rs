//! Persistent actors (issue 32): one test body on both backends. The CPU backend runs each
//! actor's host closure on the loop thread; the GPU runs its CUDA handler in the resident
//! kernel, and must agree with the closure. Order, load, priorities, backpressure, lifecycle
//! and the device pipeline; the API's checks and telemetry are in tests/actor_api.rs.

mod common;

use std::time::{Duration, Instant};

use common::actor::{msg, settled, spec, stateless, In, Out, State, WAIT};
use common::device_test;
use rand::{Rng, SeedableRng};
use warpdrive::actor::{ActorCtx, ActorSpec, ActorSystem, Backpressure, SystemConfig};
use warpdrive::{Device, Error};

device_test!(
    stateless_handlers_answer_in_order,
    gpu_smem_stateless_answer_in_order,
    |device: &Device| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(common::seed("stateless_in_order"));
        let mut system = ActorSystem::new(device).unwrap();
        let a = system
            .spawn(stateless("stateless").batch(256).capacity(8192))
            .unwrap();
        system.start().unwrap();
        // Sent before activation, so the loop takes full batches.
        let values: Vec<u32> = (0..4099).map(|_| rng.random()).collect();
        let msgs: Vec<In> = values
            .iter()
            .enumerate()
            .map(|(k, &v)| msg(k as u32, v))
            .collect();
        for chunk in msgs.chunks(1000) {
            a.send_many(chunk, 0).unwrap();
        }
        a.activate().unwrap();
        // Every message whose id is not a multiple of 3 answers, in order.
        for (k, &v) in values.iter().enumerate().filter(|(k, _)| k % 3 != 0) {
            let r = a.recv(WAIT).unwrap();
            assert_eq!(r.value.id, k as u32);
            assert_eq!(r.value.value, v.wrapping_mul(3).wrapping_add(1));
            assert_eq!(
                r.value.seen, k as u64,
                "ctx.seq counts every message handled"
            );
        }
        assert!(matches!(a.try_recv(), Ok(None)));
        let stats = settled(&a, 4099, 0);
        assert_eq!((stats.processed, stats.dropped), (4099, 0));
        system.terminate().unwrap();
    }
);

device_test!(
    stateless_requests_one_at_a_time,
    gpu_stateless_requests_one_at_a_time,
    |device: &Device| {
        // One message in flight (a closed-loop client, the round-trip bench's shape): on CUDA
        // the loop counts a lone rank's window in registers and stores a lone answer by
        // itself; every third message asks for no reply (nothing is stored for it).
        let mut rng = rand::rngs::StdRng::seed_from_u64(common::seed("stateless_one_at_a_time"));
        let mut system = ActorSystem::new(device).unwrap();
        let a = system.spawn(stateless("lone").batch(32)).unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        for k in 0..600u32 {
            let v: u32 = rng.random();
            if k % 3 == 0 {
                a.send(&msg(k, v)).unwrap();
            } else {
                let out = a.request(&msg(k, v), 0, WAIT).unwrap();
                assert_eq!(
                    (out.id, out.value, out.seen),
                    (k, v.wrapping_mul(3).wrapping_add(1), u64::from(k)),
                    "message {k}"
                );
            }
        }
        assert!(matches!(a.try_recv(), Ok(None)));
        let stats = settled(&a, 600, 0);
        assert_eq!((stats.processed, stats.dropped), (600, 0));
        system.terminate().unwrap();
    }
);

/// Messages each producer of `open_loop_load_accounts_for_every_reply` sends, and requests.
const LOAD_PER_PRODUCER: usize = 12_000;
const LOAD_REQUESTS: u32 = 1_500;

device_test!(
    open_loop_load_accounts_for_every_reply,
    gpu_open_loop_load,
    |device: &Device| open_loop_load(device, false, false, false, true)
);

device_test!(
    open_loop_load_without_tail_hint_accounts_for_every_reply,
    gpu_open_loop_load_no_hint,
    // The default options but the windows sized by the loop's rules alone
    // (`ActorSpec::tail_hint` off).
    |device: &Device| open_loop_load(device, true, true, true, false)
);

device_test!(
    open_loop_load_with_quick_stream_accounts_for_every_reply,
    gpu_open_loop_load_quick_stream,
    // Windows over one round of loads counted in registers too (`ActorSpec::quick_stream`).
    |device: &Device| open_loop_load(device, true, false, false, true)
);

device_test!(
    open_loop_load_with_wide_windows_accounts_for_every_reply,
    gpu_open_loop_load_wide,
    // Ten-slot windows after an empty read (`ActorSpec::wide_window`), with and without
    // the quick stream.
    |device: &Device| {
        open_loop_load(device, false, true, false, true);
        open_loop_load(device, true, true, false, true);
    }
);

device_test!(
    open_loop_load_with_reply_gaps_accounts_for_every_reply,
    gpu_open_loop_load_reply_gap,
    // A gap after every iteration that replied (`SystemConfig::reply_gap`), alone and with
    // the other two options.
    |device: &Device| {
        open_loop_load(device, false, false, true, true);
        open_loop_load(device, true, true, true, true);
    }
);

fn open_loop_load(device: &Device, quick: bool, wide: bool, reply_gap: bool, hint: bool) {
    // The loaded round trip's shape (`warpdrive bench actors`, round-trip-loaded), with
    // more producers: threads keep many messages in flight without waiting for replies
    // (open loop), most wanting none, in chunks of random size, while another thread's
    // requests wait for theirs. A stateless actor with batch 32, as the bench's: on CUDA
    // it takes windows of 2 to 32 slots (the small ones read in one trip and counted in
    // registers) and answers mixes of replies and silences; a small inbox laps often and
    // blocks the producers; some chunks are written slowly after their slots are claimed,
    // so the loop's windows (and its tail hint) run ahead of the slots written. Every reply
    // is accounted for by its correlation id, once, and each producer's messages are handled
    // in the order it sent them.
    const PRODUCERS: usize = 3;
    let config = SystemConfig {
        reply_gap,
        ..SystemConfig::default()
    };
    let mut system = ActorSystem::with_config(device, config).unwrap();
    let a = system
        .spawn(
            stateless("loaded")
                .batch(32)
                .capacity(512)
                .backpressure(Backpressure::Block { timeout: WAIT })
                .quick_stream(quick)
                .wide_window(wide)
                .tail_hint(hint),
        )
        .unwrap();
    system.start().unwrap();
    a.activate().unwrap();
    // Per producer: its messages (id 3·n + 1 wants a reply, 3·n none: `stateless`).
    let plans: Vec<Vec<In>> = (0..PRODUCERS)
        .map(|t| {
            let mut rng =
                rand::rngs::StdRng::seed_from_u64(common::seed("open_loop").wrapping_add(t as u64));
            (0..LOAD_PER_PRODUCER)
                .map(|j| {
                    let n = (t * LOAD_PER_PRODUCER + j) as u32;
                    msg(3 * n + u32::from(rng.random_ratio(1, 4)), rng.random())
                })
                .collect()
        })
        .collect();
    let wanted = plans.iter().flatten().filter(|m| m.id % 3 != 0).count();
    let (sent, received, requested) = std::thread::scope(|s| {
        let producers: Vec<_> = plans
            .iter()
            .enumerate()
            .map(|(t, plan)| {
                let a = a.clone();
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(
                        common::seed("open_loop_chunks").wrapping_add(t as u64),
                    );
                    // (first correlation id, the messages it numbers from there)
                    let mut sent: Vec<(u32, &[In])> = Vec::new();
                    let mut rest = &plan[..];
                    while !rest.is_empty() {
                        let n = rng.random_range(1..=40usize).min(rest.len());
                        let (chunk, tail) = rest.split_at(n);
                        if rng.random_ratio(1, 8) {
                            for m in chunk {
                                sent.push((a.send(m).unwrap(), std::slice::from_ref(m)));
                            }
                        } else if rng.random_ratio(1, 8) {
                            let pause = Duration::from_micros(rng.random_range(1..=8));
                            sent.push((a.send_many_slowly(chunk, 0, pause).unwrap(), chunk));
                        } else {
                            sent.push((a.send_many(chunk, 0).unwrap(), chunk));
                        }
                        if rng.random_ratio(1, 16) {
                            std::thread::yield_now();
                        }
                        rest = tail;
                    }
                    sent
                })
            })
            .collect();
        let requester = {
            let a = a.clone();
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(common::seed("open_loop_requests"));
                (0..LOAD_REQUESTS)
                    .map(|k| {
                        let id = 3 * (PRODUCERS * LOAD_PER_PRODUCER) as u32 + 3 * k + 1;
                        let v: u32 = rng.random();
                        let out = a.request(&msg(id, v), 0, WAIT).unwrap();
                        assert_eq!(
                            (out.id, out.value),
                            (id, v.wrapping_mul(3).wrapping_add(1)),
                            "request {k}"
                        );
                        out.seen
                    })
                    .collect::<Vec<u64>>()
            })
        };
        // The replies to the producers' messages, as they come (each within `WAIT`).
        let received: Vec<(u32, Out)> = (0..wanted)
            .map(|_| {
                let r = a.recv(WAIT).unwrap();
                (r.correlation, r.value)
            })
            .collect();
        let sent: Vec<Vec<(u32, &[In])>> =
            producers.into_iter().map(|p| p.join().unwrap()).collect();
        (sent, received, requester.join().unwrap())
    });
    let total = (PRODUCERS * LOAD_PER_PRODUCER) as u64 + u64::from(LOAD_REQUESTS);
    let stats = settled(&a, total, 0);
    assert_eq!((stats.processed, stats.dropped), (total, 0));
    assert!(a.try_recv().unwrap().is_none(), "no reply left over");
    // Each reply answers the message its correlation id names, and each message that
    // wants one has exactly one.
    let mut by_correlation = std::collections::HashMap::new();
    for (first, chunk) in sent.iter().flatten() {
        for (k, m) in chunk.iter().enumerate() {
            by_correlation.insert(first.wrapping_add(k as u32), *m);
        }
    }
    assert_eq!(by_correlation.len(), PRODUCERS * LOAD_PER_PRODUCER);
    let mut answered = std::collections::HashSet::new();
    let mut seen: Vec<u64> = requested;
    for (correlation, out) in &received {
        let m = by_correlation
            .get(correlation)
            .unwrap_or_else(|| panic!("a reply to correlation {correlation}, never sent"));
        assert_eq!(
            (out.id, out.value),
            (m.id, m.value.wrapping_mul(3).wrapping_add(1)),
            "correlation {correlation}"
        );
        assert!(m.id % 3 != 0, "message {} wanted no reply", m.id);
        assert!(
            answered.insert(*correlation),
            "two replies to {correlation}"
        );
        seen.push(out.seen);
    }
    assert_eq!(answered.len(), wanted);
    // One lane is handled in the order its slots were claimed: a producer's replies in the
    // order it sent their messages (`ctx.seq` rising).
    let seen_of: std::collections::HashMap<u32, u64> =
        received.iter().map(|(c, out)| (*c, out.seen)).collect();
    for (t, chunks) in sent.iter().enumerate() {
        let order: Vec<u64> = chunks
            .iter()
            .flat_map(|(first, chunk)| (0..chunk.len()).map(move |k| first.wrapping_add(k as u32)))
            .filter_map(|c| seen_of.get(&c).copied())
            .collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "producer {t}: replies out of order"
        );
    }
    // `ctx.seq` numbers each message handled once.
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), wanted + LOAD_REQUESTS as usize);
    assert!(seen.last().is_some_and(|&q| q < total));
    system.terminate().unwrap();
}

device_test!(
    tail_hint_ahead_of_written_slots_tears_nothing,
    gpu_tail_hint_ahead,
    // Slow senders claim whole bursts (publishing the lane's tail, `ActorSpec::tail_hint`)
    // and write them a message at a time, each slot half written for a while, beside fast
    // senders: on CUDA the loop's windows, sized by the hint, cover slots claimed and not yet
    // written or torn, which must read as not written. One lane, then two (the priority
    // picker's windows).
    |device: &Device| {
        tail_hint_ahead(device, 1);
        tail_hint_ahead(device, 2);
    }
);

fn tail_hint_ahead(device: &Device, lanes: usize) {
    // Senders 2·l (slow) and 2·l + 1 (fast) send on lane l % lanes.
    const SENDERS: usize = 4;
    const PER_SENDER: usize = 600;
    let mut system = ActorSystem::new(device).unwrap();
    let a = system
        .spawn(
            spec("ahead")
                .lanes(lanes)
                .batch(32)
                .capacity(64)
                .backpressure(Backpressure::Block { timeout: WAIT })
                .tail_hint(true),
        )
        .unwrap();
    system.start().unwrap();
    a.activate().unwrap();
    let total = SENDERS * PER_SENDER;
    let (sent, received) = std::thread::scope(|s| {
        let senders: Vec<_> = (0..SENDERS)
            .map(|t| {
                let a = a.clone();
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(
                        common::seed("tail_hint_ahead").wrapping_add((lanes * SENDERS + t) as u64),
                    );
                    let lane = (t / 2) % lanes;
                    let plan: Vec<In> = (0..PER_SENDER)
                        .map(|j| msg((t * PER_SENDER + j) as u32, rng.random()))
                        .collect();
                    // (first correlation id, lane, the messages it numbers from there)
                    let mut sent: Vec<(u32, usize, Vec<In>)> = Vec::new();
                    let mut rest = &plan[..];
                    while !rest.is_empty() {
                        let n = rng.random_range(1..=24usize).min(rest.len());
                        let (chunk, tail) = rest.split_at(n);
                        let first = if t % 2 == 0 {
                            let pause = Duration::from_micros(rng.random_range(1..=20));
                            a.send_many_slowly(chunk, lane, pause).unwrap()
                        } else {
                            a.send_many(chunk, lane).unwrap()
                        };
                        sent.push((first, lane, chunk.to_vec()));
                        rest = tail;
                    }
                    sent
                })
            })
            .collect();
        // Every message is answered (the stateful echo replies to each).
        let received: Vec<(u32, Out)> = (0..total)
            .map(|_| {
                let r = a.recv(WAIT).unwrap();
                (r.correlation, r.value)
            })
            .collect();
        let sent: Vec<Vec<(u32, usize, Vec<In>)>> =
            senders.into_iter().map(|h| h.join().unwrap()).collect();
        (sent, received)
    });
    let stats = settled(&a, total as u64, 0);
    assert_eq!((stats.processed, stats.dropped), (total as u64, 0));
    assert!(a.try_recv().unwrap().is_none(), "no reply left over");
    let mut by_correlation = std::collections::HashMap::new();
    for (first, lane, chunk) in sent.iter().flatten() {
        for (k, m) in chunk.iter().enumerate() {
            by_correlation.insert(first.wrapping_add(k as u32), (*lane, *m));
        }
    }
    assert_eq!(by_correlation.len(), total);
    // Each message whole (its id, value and lane), answered once.
    let mut seen_of = std::collections::HashMap::new();
    for (correlation, out) in &received {
        let (lane, m) = by_correlation
            .get(correlation)
            .unwrap_or_else(|| panic!("a reply to correlation {correlation}, never sent"));
        assert_eq!(
            (out.id, out.value, out.lane),
            (m.id, m.value.wrapping_mul(3).wrapping_add(1), *lane as u32),
            "correlation {correlation}"
        );
        assert!(
            seen_of.insert(*correlation, out.seen).is_none(),
            "two replies to {correlation}"
        );
    }
    // The state counts each message once, and a sender's messages are handled in the order
    // it sent them (a lane in the order its slots were claimed).
    let mut seen: Vec<u64> = seen_of.values().copied().collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..total as u64).collect::<Vec<_>>());
    for (t, chunks) in sent.iter().enumerate() {
        let order: Vec<u64> = chunks
            .iter()
            .flat_map(|(first, _, chunk)| {
                (0..chunk.len()).map(move |k| first.wrapping_add(k as u32))
            })
            .map(|c| seen_of[&c])
            .collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "sender {t}: handled out of order"
        );
    }
    system.terminate().unwrap();
}

device_test!(
    actors_answer_in_order,
    gpu_smem_actors_answer_in_order,
    |device: &Device| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(common::seed("actors_answer_in_order"));
        let mut system = ActorSystem::new(device).unwrap();
        let a = system.spawn(spec("echo").batch(16)).unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        let values: Vec<u32> = (0..1000).map(|_| rng.random()).collect();
        let mut expected_sum = 0u64;
        for (k, &v) in values.iter().enumerate() {
            let id = a.send(&msg(k as u32, v)).unwrap();
            assert_eq!(id, k as u32 + 1, "correlation ids count from 1");
            expected_sum += v as u64;
        }
        for (k, &v) in values.iter().enumerate() {
            let r = a.recv(WAIT).unwrap();
            assert_eq!(r.correlation, k as u32 + 1);
            assert_eq!(r.value.id, k as u32);
            assert_eq!(r.value.value, v.wrapping_mul(3).wrapping_add(1));
            assert_eq!(r.value.seen, k as u64, "handled in order");
        }
        a.deactivate().unwrap();
        let state: State = a.state().unwrap();
        assert_eq!(
            state,
            State {
                count: 1000,
                sum: expected_sum
            }
        );
        let stats = settled(&a, 1000, 0);
        assert_eq!(
            (stats.processed, stats.dropped, stats.rejected),
            (1000, 0, 0)
        );
        let took = system.terminate().unwrap();
        assert!(took < Duration::from_secs(1), "terminate took {took:?}");
        assert!(matches!(a.send(&msg(0, 0)), Err(Error::Actor { .. })));
    }
);

device_test!(
    requests_from_many_threads_get_their_own_replies,
    gpu_requests_from_many_threads,
    |device: &Device| {
        let mut system = ActorSystem::new(device).unwrap();
        let a = system.spawn(spec("req")).unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let a = a.clone();
                s.spawn(move || {
                    for k in 0..300u32 {
                        let v = t * 100_000 + k;
                        let out = a.request(&msg(v, v), 0, WAIT).unwrap();
                        assert_eq!((out.id, out.value), (v, v * 3 + 1));
                    }
                });
            }
        });
        assert_eq!(settled(&a, 1200, 0).processed, 1200);
        assert!(a.try_recv().unwrap().is_none(), "no reply left over");
    }
);

device_test!(
    higher_lanes_first_with_bounded_starvation,
    gpu_higher_lanes_first,
    |device: &Device| {
        let mut system = ActorSystem::new(device).unwrap();
        let a = system
            .spawn(spec("lanes").lanes(2).batch(8).starvation_limit(4))
            .unwrap();
        system.start().unwrap();
        for k in 0..20 {
            a.send_lane(&msg(k, k), 0).unwrap();
        }
        for k in 0..20 {
            a.send_lane(&msg(100 + k, k), 1).unwrap();
        }
        a.activate().unwrap();
        let lanes: Vec<u32> = (0..40).map(|_| a.recv(WAIT).unwrap().value.lane).collect();
        // Lane 1 first; while it has a backlog, lane 0 gets one message in every five.
        let mut expected: Vec<u32> = (0..5).flat_map(|_| [1, 1, 1, 1, 0]).collect();
        expected.extend([0; 15]);
        assert_eq!(lanes, expected);
    }
);

device_test!(
    reject_refuses_exactly_what_does_not_fit,
    gpu_reject_refuses,
    |device: &Device| {
        let mut system = ActorSystem::new(device).unwrap();
        let a = system
            .spawn(
                spec("reject")
                    .capacity(16)
                    .backpressure(Backpressure::Reject),
            )
            .unwrap();
        system.start().unwrap();
        for k in 0..16 {
            a.send(&msg(k, k)).unwrap();
        }
        for _ in 0..3 {
            assert!(matches!(
                a.send(&msg(99, 99)),
                Err(Error::QueueFull { capacity: 16, .. })
            ));
        }
        a.activate().unwrap();
        for k in 0..16 {
            assert_eq!(a.recv(WAIT).unwrap().value.id, k);
        }
        let stats = settled(&a, 16, 0);
        assert_eq!((stats.processed, stats.rejected, stats.dropped), (16, 3, 0));
    }
);

device_test!(
    block_loses_nothing_under_a_fast_producer,
    gpu_block_loses_nothing,
    |device: &Device| {
        let mut system = ActorSystem::new(device).unwrap();
        let a = system
            .spawn(
                spec("block")
                    .capacity(16)
                    .batch(4)
                    .backpressure(Backpressure::Block {
                        timeout: Duration::from_secs(10),
                    }),
            )
            .unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        let n = 400u32;
        std::thread::scope(|s| {
            let producer = a.clone();
            s.spawn(move || {
                for k in 0..n {
                    // 20 µs of handling a message, far slower than sending one.
                    let mut m = msg(k, k);
                    m.busy_ns = 20_000;
                    producer.send(&m).unwrap();
                }
            });
            for k in 0..n {
                let r = a.recv(WAIT).unwrap();
                assert_eq!(r.value.id, k);
            }
        });
        let stats = settled(&a, n as u64, 0);
        assert_eq!(
            (stats.processed, stats.rejected, stats.dropped),
            (n as u64, 0, 0)
        );
        assert!(
            stats.max_depth >= 8,
            "the producer ran ahead: max depth {}",
            stats.max_depth
        );
    }
);

device_test!(
    drop_oldest_counts_what_never_arrived,
    gpu_drop_oldest_counts,
    |device: &Device| drop_oldest_counts(device, false, false)
);

device_test!(
    drop_oldest_counts_with_quick_stream,
    gpu_drop_oldest_counts_quick_stream,
    // The overwritten slots of windows over one round of loads marked for the priority
    // picker as a one-trip read's are (`ActorSpec::quick_stream`).
    |device: &Device| {
        drop_oldest_counts(device, true, false);
        // And with ten-slot windows after an empty read (`ActorSpec::wide_window`).
        drop_oldest_counts(device, true, true);
    }
);

fn drop_oldest_counts(device: &Device, quick: bool, wide: bool) {
    let mut system = ActorSystem::new(device).unwrap();
    let a = system
        .spawn(
            spec("drop")
                .capacity(16)
                .backpressure(Backpressure::DropOldest)
                .quick_stream(quick)
                .wide_window(wide),
        )
        .unwrap();
    system.start().unwrap();
    for k in 0..100 {
        a.send(&msg(k, k)).unwrap();
    }
    a.activate().unwrap();
    let got: Vec<u32> = (0..16).map(|_| a.recv(WAIT).unwrap().value.id).collect();
    assert_eq!(got, (84..100).collect::<Vec<_>>(), "the newest 16 survive");
    let stats = settled(&a, 16, 84);
    assert_eq!((stats.processed, stats.dropped), (16, 84));
    assert!(a.try_recv().unwrap().is_none());
}

device_test!(
    terminate_during_traffic_ends_senders_cleanly,
    gpu_terminate_during_traffic,
    |device: &Device| {
        let mut system = ActorSystem::new(device).unwrap();
        let a = system.spawn(spec("busy").capacity(64)).unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        let producer = a.clone();
        let sender = std::thread::spawn(move || {
            let mut sent = 0u64;
            loop {
                match producer.send(&msg(0, 1)) {
                    Ok(_) => sent += 1,
                    Err(e) => return (sent, e),
                }
                while producer.try_recv().ok().flatten().is_some() {}
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        let took = system.terminate().unwrap();
        let (sent, err) = sender.join().unwrap();
        assert!(sent > 0);
        assert!(matches!(err, Error::Actor { .. }), "{err}");
        assert!(took < Duration::from_secs(1), "terminate took {took:?}");
    }
);

device_test!(
    a_host_that_stops_beating_parks_the_loop,
    gpu_host_silence_parks,
    |device: &Device| {
        let config = SystemConfig {
            park_after: Duration::from_millis(20),
            ..SystemConfig::default()
        };
        let mut system = ActorSystem::with_config(device, config).unwrap();
        let a = system.spawn(spec("park")).unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        assert_eq!(a.request(&msg(1, 1), 0, WAIT).unwrap().value, 4);
        system.set_host_beat(false);
        let t0 = Instant::now();
        while !system.is_parked() {
            assert!(t0.elapsed() < WAIT, "never parked");
            std::thread::sleep(Duration::from_millis(1));
        }
        a.send(&msg(2, 2)).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            a.try_recv().unwrap().is_none(),
            "a parked loop handles nothing"
        );
        system.set_host_beat(true);
        assert_eq!(a.recv(WAIT).unwrap().value.value, 7);
        assert!(!system.is_parked());
    }
);

device_test!(
    a_loop_that_stops_beating_is_reported_hung,
    gpu_hung_loop_reported,
    |device: &Device| {
        let config = SystemConfig {
            hang_after: Duration::from_millis(100),
            ..SystemConfig::default()
        };
        let mut system = ActorSystem::with_config(device, config).unwrap();
        let a = system.spawn(spec("hang")).unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        // The handler stays 600 ms on one message: the loop stops beating meanwhile.
        let mut m = msg(1, 1);
        m.busy_ns = 600_000_000;
        a.send(&m).unwrap();
        let t0 = Instant::now();
        let err = loop {
            match a.send(&msg(2, 2)) {
                Err(e) => break e,
                Ok(_) => std::thread::sleep(Duration::from_millis(5)),
            }
            assert!(t0.elapsed() < WAIT, "never reported hung");
        };
        assert!(err.to_string().contains("hung"), "{err}");
        // Once the handler returns, the loop ends when told.
        system.terminate().unwrap();
    }
);

device_test!(
    a_device_pipeline_needs_no_host,
    gpu_smem_device_pipeline,
    |device: &Device| {
        let mut system = ActorSystem::new(device).unwrap();
        // Stage two takes stage one's output (an `Out` seen as the next `In`: same 64 bytes).
        let second = system
        .spawn(
            ActorSpec::<Out, Out, State>::new("second", State::default())
                .cuda(
                    "struct In { u32 id; u32 value; u64 seen; u32 lane; u32 pad[11]; };\n\
                     typedef In Out;\nstruct State { u64 count; u64 sum; };\n\
                     __device__ void handle(const In* in, Out* out, State* s, ActorCtx*) {\n\
                     *out = *in; out->value = in->value + 7u; out->seen = s->count; s->count += 1; }",
                )
                .host(|i: &Out, o: &mut Out, s: &mut State, _: &mut ActorCtx| {
                    *o = *i;
                    o.value = i.value.wrapping_add(7);
                    o.seen = s.count;
                    s.count += 1;
                })
                .capacity(32),
        )
        .unwrap();
        let first = system.spawn(spec("first").forward_to(&second)).unwrap();
        system.start().unwrap();
        first.activate().unwrap();
        second.activate().unwrap();
        let n = 2000u32;
        for k in 0..n {
            first.send(&msg(k, k)).unwrap();
        }
        for k in 0..n {
            let r = second.recv(WAIT).unwrap();
            assert_eq!(
                (r.value.id, r.value.value, r.value.seen),
                (k, 3 * k + 1 + 7, k as u64)
            );
        }
        assert_eq!(first.stats().forwarded, n as u64);
        assert!(
            first.try_recv().is_err(),
            "a forwarding actor has no replies for the host"
        );
    }
);

device_test!(
    other_gpu_work_runs_beside_the_actors,
    gpu_other_work_beside_actors,
    |device: &Device| {
        use warpdrive::ops;
        let mut system = ActorSystem::new(device).unwrap();
        let a = system.spawn(spec("beside")).unwrap();
        system.start().unwrap();
        a.activate().unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        // Set on the way out, a failed assertion's too: the scope waits for the producer.
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        std::thread::scope(|s| {
            let producer = a.clone();
            let stop = &stop;
            let _stop = StopOnDrop(stop);
            s.spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    producer.request(&msg(1, 1), 0, WAIT).unwrap();
                }
            });
            let stream = device.new_stream().unwrap();
            let host: Vec<f32> = (0..(1 << 20)).map(|i| (i % 977) as f32).collect();
            for round in 0..3 {
                // A transfer, an op and a graph replay, each on streams of their own.
                let step = |what: &str| eprintln!("beside the actors, round {round}: {what}");
                step("upload");
                let x = warpdrive::Buffer::from_host(&stream, &host).unwrap();
                step("zeros");
                let mut y = warpdrive::Buffer::<f32>::zeros(&stream, host.len()).unwrap();
                step("axpy");
                ops::axpy(&stream, 2.0, &x, &mut y).unwrap();
                step("download");
                let got = y.to_host(&stream).unwrap();
                assert!(got.iter().zip(&host).all(|(g, h)| *g == 2.0 * h));
                step("capture");
                let mut graph =
                    warpdrive::exec::Graph::capture(&stream, |s| ops::axpy(s, 1.0, &x, &mut y))
                        .unwrap();
                step("replay");
                graph.launch().unwrap();
                step("drop the graph");
                drop(graph);
                step("download");
                let got = y.to_host(&stream).unwrap();
                assert!(got.iter().zip(&host).all(|(g, h)| *g == 3.0 * h));
                step("done");
            }
            assert!(
                device.synchronize().is_err() || device.is_host_memory(),
                "a device-wide synchronize is refused while actors run"
            );
        });
        assert!(a.stats().processed > 0);
    }
);
