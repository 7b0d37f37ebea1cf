//! The collectives (`dist`), one test body on the in-process CPU group and on NCCL (and the
//! collectives' bodies on the CPU group across processes, over shared memory and TCP): every
//! collective against a scalar reference computed here, one thread per rank, world sizes 1
//! to 4 (CPU) or 1 to the GPUs (NCCL) and odd lengths; back-to-back steps; ranks that
//! disagree; send / receive, groups, the Reducer, split and the hierarchy. Failures of the CPU
//! group are in `dist_faults.rs`, starting ranks as torchrun does in `dist_launch.rs`, the
//! compressed all-reduce and the training check in `dist_compress.rs`.
//!
//! Tolerances: f32 and f64 sums and averages within 1e-6 (f32) / 1e-12 (f64) of the sum of
//! the terms' magnitudes; everything else (f16, bf16, max, min, data movement) exact against
//! the f64-accumulate-then-round reference (on NCCL beyond two ranks, half-precision sums
//! within the type's tolerance: NCCL rounds at every hop).

mod common;

use std::time::Duration;

use common::ranks::{both_backends, each_rank_on, Backend, PATIENT};
use common::{each_rank, group, is_collective, is_invalid, random_in, rng, seed, TestFloat};
use rand::rngs::StdRng;
use rand::Rng;
use warpdrive::dist::{Comm, ReduceOp, Reducer, BUCKET_CANDIDATES};
use warpdrive::{bf16, f16, Buffer, DType, Device, Error, Float};

const OPS: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Average,
];

/// The reduction of `values` (in rank order) as the reference computes it: f64, rounded once.
fn reduced<T: Float>(op: ReduceOp, values: impl Iterator<Item = T>) -> T {
    let values: Vec<f64> = values.map(Float::to_f64).collect();
    let n = values.len() as f64;
    let v = match op {
        ReduceOp::Sum => values.iter().sum(),
        ReduceOp::Average => values.iter().sum::<f64>() / n,
        ReduceOp::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => values.iter().copied().fold(f64::INFINITY, f64::min),
    };
    T::from_f64(v)
}

/// Checks `got` against the reference reduction of `inputs` (one slice per rank) at each
/// element, `offset` elements into the inputs.
fn check_reduced<T: TestFloat>(
    what: &str,
    op: ReduceOp,
    inputs: &[Vec<T>],
    offset: usize,
    got: &[T],
    tol: f64,
    backend: Backend,
) {
    // NCCL rounds a half-precision sum at every hop of its ring: exact against the one
    // rounding of the reference only up to two ranks; beyond, within the type's tolerance.
    let hops = backend == Backend::Nccl && inputs.len() > 2;
    for (i, &g) in got.iter().enumerate() {
        let terms = inputs.iter().map(|x| x[offset + i]);
        let want = reduced(op, terms.clone()).to_f64();
        let g = g.to_f64();
        let minmax = matches!(op, ReduceOp::Max | ReduceOp::Min);
        let exact = (T::NAME != "f32" && T::NAME != "f64" && !hops) || minmax;
        let tol = if T::NAME != "f32" && T::NAME != "f64" {
            T::TOL
        } else {
            tol
        };
        let bound = if exact {
            0.0
        } else {
            tol * terms.map(|t| t.to_f64().abs()).sum::<f64>()
        };
        assert!(
            (g - want).abs() <= bound,
            "{what} {} {op:?} element {i}: got {g}, want {want} (bound {bound})",
            T::NAME
        );
    }
}

/// The bound of a sum or average relative to the terms' magnitudes (0: exact).
trait TestFloatTol: TestFloat {
    const SUM_TOL: f64;
}
impl TestFloatTol for f32 {
    const SUM_TOL: f64 = 1e-6;
}
impl TestFloatTol for f16 {
    const SUM_TOL: f64 = 0.0;
}
impl TestFloatTol for bf16 {
    const SUM_TOL: f64 = 0.0;
}

fn all_reduce_case<T: TestFloatTol>(
    backend: Backend,
    rng: &mut StdRng,
    world: usize,
    len: usize,
    op: ReduceOp,
) {
    let inputs: Vec<Vec<T>> = (0..world)
        .map(|_| random_in::<T>(rng, len, -1.0, 1.0))
        .collect();
    let outs = each_rank_on(backend, world, |comm, stream| {
        let mut buf = Buffer::from_host(stream, &inputs[comm.rank()]).unwrap();
        comm.all_reduce(stream, &mut buf, op).unwrap();
        buf.to_host(stream).unwrap()
    });
    let what = format!("all_reduce world {world} len {len}");
    for out in &outs {
        assert_eq!(out.len(), len);
        assert!(
            out.iter()
                .zip(&outs[0])
                .all(|(a, b)| a.to_bits_u64() == b.to_bits_u64()),
            "{what}: ranks' results differ"
        );
    }
    check_reduced(&what, op, &inputs, 0, &outs[0], T::SUM_TOL, backend);
}

both_backends!(
    all_reduce_matches_the_reference_for_every_op_and_type,
    gpu_nccl_all_reduce_matches_the_reference_for_every_op_and_type,
    procs_all_reduce_matches_the_reference_for_every_op_and_type,
    |backend| {
        let mut rng = rng(seed("all_reduce"));
        for world in backend.worlds() {
            for len in [1, 7, 1003] {
                for op in OPS {
                    all_reduce_case::<f32>(backend, &mut rng, world, len, op);
                    all_reduce_case::<f16>(backend, &mut rng, world, len, op);
                    all_reduce_case::<bf16>(backend, &mut rng, world, len, op);
                }
            }
            all_reduce_case::<f32>(backend, &mut rng, world, 1_000_003, ReduceOp::Sum);
        }
    }
);

#[test]
fn large_slices_reduce_on_the_copy_threads_to_the_same_result() {
    // Each rank's slice is over 4 MiB: the CPU group splits it over the host's copy threads
    // (an odd length, so the last piece is short).
    let mut rng = rng(seed("all_reduce_large"));
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Average] {
        all_reduce_case::<f32>(Backend::Cpu, &mut rng, 2, 2_500_003, op);
    }
}

#[test]
fn all_reduce_of_f64_is_within_the_f64_bound() {
    let mut rng = rng(seed("all_reduce_f64"));
    for world in 1..=4 {
        for op in OPS {
            let len = 1001;
            let inputs: Vec<Vec<f64>> = (0..world)
                .map(|_| (0..len).map(|_| rng.random_range(-1.0..1.0)).collect())
                .collect();
            let outs = each_rank(group(world, PATIENT), |comm, stream| {
                let mut buf = Buffer::from_host(stream, &inputs[comm.rank()]).unwrap();
                comm.all_reduce(stream, &mut buf, op).unwrap();
                buf.to_host(stream).unwrap()
            });
            for out in outs {
                for (i, g) in out.iter().enumerate() {
                    let terms = inputs.iter().map(|x| x[i]);
                    let want = reduced(op, terms.clone());
                    let bound = 1e-12 * terms.map(f64::abs).sum::<f64>();
                    assert!((g - want).abs() <= bound, "{op:?} [{i}]: {g} vs {want}");
                }
            }
        }
    }
}

/// A value with random bits and the low bit set (so never the poison, whose low bit is 0).
fn random_bits<T: DType>(rng: &mut StdRng) -> T {
    T::from_bits_u64(rng.random::<u64>() | 1)
}

fn poison<T: DType>() -> T {
    T::from_bits_u64(0xa5a5_a5a5_a5a5_a5a4)
}

fn bits<T: DType>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits_u64()).collect()
}

fn broadcast_case<T: DType>(
    backend: Backend,
    rng: &mut StdRng,
    world: usize,
    len: usize,
    root: usize,
) {
    let data: Vec<T> = (0..len).map(|_| random_bits(rng)).collect();
    let outs = each_rank_on(backend, world, |comm, stream| {
        let init = if comm.rank() == root {
            data.clone()
        } else {
            vec![poison::<T>(); len]
        };
        let mut buf = Buffer::from_host(stream, &init).unwrap();
        comm.broadcast(stream, &mut buf, root).unwrap();
        buf.to_host(stream).unwrap()
    });
    for (rank, out) in outs.iter().enumerate() {
        assert_eq!(
            bits(out),
            bits(&data),
            "broadcast {} world {world} len {len} root {root}: rank {rank}",
            T::KIND.name()
        );
    }
}

both_backends!(
    broadcast_copies_the_root_to_every_rank,
    gpu_nccl_broadcast_copies_the_root_to_every_rank,
    procs_broadcast_copies_the_root_to_every_rank,
    |backend| {
        let mut rng = rng(seed("broadcast"));
        for world in backend.worlds() {
            for root in 0..world {
                for len in [0, 1, 7, 1003] {
                    broadcast_case::<u8>(backend, &mut rng, world, len, root);
                    broadcast_case::<i64>(backend, &mut rng, world, len, root);
                    broadcast_case::<f32>(backend, &mut rng, world, len, root);
                    broadcast_case::<bf16>(backend, &mut rng, world, len, root);
                }
            }
        }
    }
);

fn all_gather_case<T: DType>(backend: Backend, rng: &mut StdRng, world: usize, len: usize) {
    let inputs: Vec<Vec<T>> = (0..world)
        .map(|_| (0..len).map(|_| random_bits(rng)).collect())
        .collect();
    let outs = each_rank_on(backend, world, |comm, stream| {
        let input = Buffer::from_host(stream, &inputs[comm.rank()]).unwrap();
        let mut output = Buffer::from_host(stream, &vec![poison::<T>(); world * len]).unwrap();
        comm.all_gather(stream, &input, &mut output).unwrap();
        output.to_host(stream).unwrap()
    });
    let want: Vec<T> = inputs.concat();
    for (rank, out) in outs.iter().enumerate() {
        assert_eq!(
            bits(out),
            bits(&want),
            "all_gather {} world {world} len {len}: rank {rank}",
            T::KIND.name()
        );
    }
}

both_backends!(
    all_gather_concatenates_in_rank_order,
    gpu_nccl_all_gather_concatenates_in_rank_order,
    procs_all_gather_concatenates_in_rank_order,
    |backend| {
        let mut rng = rng(seed("all_gather"));
        for world in backend.worlds() {
            for len in [0, 1, 7, 1003] {
                all_gather_case::<f32>(backend, &mut rng, world, len);
                all_gather_case::<u32>(backend, &mut rng, world, len);
                all_gather_case::<f16>(backend, &mut rng, world, len);
            }
        }
    }
);

fn reduce_scatter_case<T: TestFloatTol>(
    backend: Backend,
    rng: &mut StdRng,
    world: usize,
    m: usize,
    op: ReduceOp,
) {
    let inputs: Vec<Vec<T>> = (0..world)
        .map(|_| random_in::<T>(rng, world * m, -1.0, 1.0))
        .collect();
    let outs = each_rank_on(backend, world, |comm, stream| {
        let input = Buffer::from_host(stream, &inputs[comm.rank()]).unwrap();
        let mut output = Buffer::from_host(stream, &vec![common::nan::<T>(); m]).unwrap();
        comm.reduce_scatter(stream, &input, &mut output, op)
            .unwrap();
        output.to_host(stream).unwrap()
    });
    for (rank, out) in outs.iter().enumerate() {
        assert_eq!(out.len(), m);
        let what = format!("reduce_scatter world {world} m {m} rank {rank}");
        check_reduced(&what, op, &inputs, rank * m, out, T::SUM_TOL, backend);
    }
}

both_backends!(
    reduce_scatter_gives_each_rank_its_reduced_slice,
    gpu_nccl_reduce_scatter_gives_each_rank_its_reduced_slice,
    procs_reduce_scatter_gives_each_rank_its_reduced_slice,
    |backend| {
        let mut rng = rng(seed("reduce_scatter"));
        for world in backend.worlds() {
            for m in [1, 7, 333] {
                for op in OPS {
                    reduce_scatter_case::<f32>(backend, &mut rng, world, m, op);
                    reduce_scatter_case::<bf16>(backend, &mut rng, world, m, op);
                }
            }
        }
    }
);

fn all_to_all_case<T: DType>(backend: Backend, rng: &mut StdRng, world: usize, chunk: usize) {
    let inputs: Vec<Vec<T>> = (0..world)
        .map(|_| (0..world * chunk).map(|_| random_bits(rng)).collect())
        .collect();
    let outs = each_rank_on(backend, world, |comm, stream| {
        let input = Buffer::from_host(stream, &inputs[comm.rank()]).unwrap();
        let mut output = Buffer::from_host(stream, &vec![poison::<T>(); world * chunk]).unwrap();
        comm.all_to_all(stream, &input, &mut output).unwrap();
        output.to_host(stream).unwrap()
    });
    for (j, out) in outs.iter().enumerate() {
        // Chunk i of rank j's output is chunk j of rank i's input.
        let want: Vec<T> = (0..world)
            .flat_map(|i| inputs[i][j * chunk..(j + 1) * chunk].iter().copied())
            .collect();
        assert_eq!(
            bits(out),
            bits(&want),
            "all_to_all {} world {world} chunk {chunk}: rank {j}",
            T::KIND.name()
        );
    }
}

both_backends!(
    all_to_all_sends_chunk_j_of_rank_i_to_chunk_i_of_rank_j,
    gpu_nccl_all_to_all_sends_chunk_j_of_rank_i_to_chunk_i_of_rank_j,
    procs_all_to_all_sends_chunk_j_of_rank_i_to_chunk_i_of_rank_j,
    |backend| {
        let mut rng = rng(seed("all_to_all"));
        for world in backend.worlds() {
            for chunk in [0, 1, 7, 101] {
                all_to_all_case::<u64>(backend, &mut rng, world, chunk);
                all_to_all_case::<f16>(backend, &mut rng, world, chunk);
            }
        }
    }
);

fn all_to_all_v_case<T: DType>(backend: Backend, rng: &mut StdRng, world: usize) {
    // counts[i][j]: what rank i sends to rank j (zero included).
    let counts: Vec<Vec<usize>> = (0..world)
        .map(|_| (0..world).map(|_| rng.random_range(0..6)).collect())
        .collect();
    let inputs: Vec<Vec<T>> = counts
        .iter()
        .map(|row| {
            (0..row.iter().sum::<usize>())
                .map(|_| random_bits(rng))
                .collect()
        })
        .collect();
    let outs = each_rank_on(backend, world, |comm, stream| {
        let me = comm.rank();
        let send = &counts[me];
        let recv: Vec<usize> = (0..world).map(|i| counts[i][me]).collect();
        let input = Buffer::from_host(stream, &inputs[me]).unwrap();
        let total = recv.iter().sum::<usize>();
        let mut output = Buffer::from_host(stream, &vec![poison::<T>(); total]).unwrap();
        comm.all_to_all_v(stream, &input, send, &mut output, &recv)
            .unwrap();
        output.to_host(stream).unwrap()
    });
    for (j, out) in outs.iter().enumerate() {
        let want: Vec<T> = (0..world)
            .flat_map(|i| {
                let from: usize = counts[i][..j].iter().sum();
                inputs[i][from..from + counts[i][j]].iter().copied()
            })
            .collect();
        assert_eq!(
            bits(out),
            bits(&want),
            "all_to_all_v {} world {world} counts {counts:?}: rank {j}",
            T::KIND.name()
        );
    }
}

both_backends!(
    all_to_all_v_moves_each_ranks_counts,
    gpu_nccl_all_to_all_v_moves_each_ranks_counts,
    procs_all_to_all_v_moves_each_ranks_counts,
    |backend| {
        let mut rng = rng(seed("all_to_all_v"));
        for world in backend.worlds() {
            for _ in 0..5 {
                all_to_all_v_case::<f32>(backend, &mut rng, world);
                all_to_all_v_case::<u8>(backend, &mut rng, world);
            }
        }
    }
);

both_backends!(
    a_group_runs_a_ring_exchange_and_collectives_together,
    gpu_nccl_a_group_runs_a_ring_exchange_and_collectives_together,
    procs_a_group_runs_a_ring_exchange_and_collectives_together,
    |backend| {
        for world in backend.worlds() {
            let outs = each_rank_on(backend, world, |comm, stream| {
                let me = comm.rank();
                let mine = Buffer::from_host(stream, &vec![me as f32 + 1.0; 999]).unwrap();
                let mut got = Buffer::from_host(stream, &[f32::NAN; 999]).unwrap();
                let mut a = Buffer::from_host(stream, &[1.0f32; 5]).unwrap();
                let mut b = Buffer::from_host(stream, &[me as f32; 3]).unwrap();
                comm.group(|c| {
                    // Every rank sends to the next and receives from the one before: on
                    // NCCL only a group lets these run (each send waits for its receive).
                    if world > 1 {
                        c.send(stream, &mine, (me + 1) % world)?;
                        c.recv(stream, &mut got, (me + world - 1) % world)?;
                    }
                    c.all_reduce(stream, &mut a, ReduceOp::Sum)?;
                    c.all_reduce(stream, &mut b, ReduceOp::Max)
                })
                .unwrap();
                comm.wait(stream).unwrap();
                let got = (world > 1).then(|| got.to_host(stream).unwrap());
                (got, a.to_host(stream).unwrap(), b.to_host(stream).unwrap())
            });
            for (r, (got, a, b)) in outs.into_iter().enumerate() {
                if let Some(got) = got {
                    let from = (r + world - 1) % world;
                    assert_eq!(got, vec![from as f32 + 1.0; 999], "world {world} rank {r}");
                }
                assert_eq!(a, vec![world as f32; 5]);
                assert_eq!(b, vec![(world - 1) as f32; 3]);
            }
        }
    }
);

both_backends!(
    the_reducer_averages_gradients_bucket_by_bucket,
    gpu_nccl_the_reducer_averages_gradients_bucket_by_bucket,
    |backend| {
        // 16 KiB buckets of f32: [1, 1000], [5000], [3], [70000] (larger than a bucket:
        // its own), [7].
        const SIZES: [usize; 6] = [1, 1000, 5000, 3, 70_000, 7];
        let mut rng = rng(seed("reducer"));
        for world in backend.worlds() {
            let grads: Vec<Vec<Vec<f32>>> = (0..world)
                .map(|_| {
                    SIZES
                        .iter()
                        .map(|&n| common::random_f32(&mut rng, n))
                        .collect()
                })
                .collect();
            let outs = each_rank_on(backend, world, |comm, stream| {
                let device = stream.device();
                let mut reducer = Reducer::new(device, 16 << 10).unwrap();
                let mut bufs: Vec<Buffer<f32>> = grads[comm.rank()]
                    .iter()
                    .map(|g| Buffer::from_host(stream, g).unwrap())
                    .collect();
                let events: Vec<_> = bufs
                    .iter()
                    .map(|_| {
                        let e = device.new_event().unwrap();
                        stream.record(&e).unwrap();
                        e
                    })
                    .collect();
                let mut pairs: Vec<_> = bufs.iter_mut().zip(&events).collect();
                let stats = reducer.all_reduce(comm, stream, &mut pairs).unwrap();
                comm.wait(reducer.stream()).unwrap();
                let out: Vec<Vec<f32>> = bufs.iter().map(|b| b.to_host(stream).unwrap()).collect();
                (stats, out)
            });
            for (rank, (stats, out)) in outs.iter().enumerate() {
                assert_eq!(stats.buckets, 5);
                assert_eq!(stats.bytes, SIZES.iter().sum::<usize>() * 4);
                for (g, got) in out.iter().enumerate() {
                    let inputs: Vec<Vec<f32>> = grads.iter().map(|r| r[g].clone()).collect();
                    let what = format!("reducer world {world} rank {rank} grad {g}");
                    check_reduced(&what, ReduceOp::Average, &inputs, 0, got, 1e-6, backend);
                }
            }
        }
    }
);

both_backends!(
    a_comm_of_another_cta_policy_keeps_the_ranks_and_reduces_alike,
    gpu_nccl_a_comm_of_another_cta_policy_keeps_the_ranks_and_reduces_alike,
    |backend| {
        use warpdrive::dist::CtaPolicy;
        for world in backend.worlds() {
            let outs = each_rank_on(backend, world, |comm, stream| {
                let lean = comm.with_cta_policy(CtaPolicy::Efficiency).unwrap();
                let mut buf = Buffer::from_host(stream, &[comm.rank() as f32 + 1.0; 5]).unwrap();
                lean.all_reduce(stream, &mut buf, ReduceOp::Sum).unwrap();
                lean.wait(stream).unwrap();
                // The first communicator still works beside the new one.
                let mut again = Buffer::from_host(stream, &[1.0f32; 3]).unwrap();
                comm.all_reduce(stream, &mut again, ReduceOp::Sum).unwrap();
                comm.wait(stream).unwrap();
                (
                    (lean.rank(), lean.world()),
                    buf.to_host(stream).unwrap(),
                    again.to_host(stream).unwrap(),
                )
            });
            let want: f32 = (1..=world).map(|r| r as f32).sum();
            for (r, (place, sum, again)) in outs.into_iter().enumerate() {
                assert_eq!(place, (r, world), "world {world}");
                assert_eq!(sum, [want; 5], "world {world} rank {r}");
                assert_eq!(again, [world as f32; 3], "world {world} rank {r}");
            }
        }
    }
);

both_backends!(
    split_groups_ranks_by_color_in_key_order,
    gpu_nccl_split_groups_ranks_by_color_in_key_order,
    |backend| {
        for world in backend.worlds() {
            let outs = each_rank_on(backend, world, |comm, stream| {
                // Two colors (even and odd ranks), keys reversing the order.
                let sub = comm.split(comm.rank() % 2, world - comm.rank()).unwrap();
                let mut buf = Buffer::from_host(stream, &[comm.rank() as f32 + 1.0; 4]).unwrap();
                sub.all_reduce(stream, &mut buf, ReduceOp::Sum).unwrap();
                sub.wait(stream).unwrap();
                (sub.rank(), sub.world(), buf.to_host(stream).unwrap()[0])
            });
            for (r, (sub_rank, sub_world, sum)) in outs.into_iter().enumerate() {
                let same: Vec<usize> = (0..world).filter(|q| q % 2 == r % 2).collect();
                assert_eq!(sub_world, same.len(), "world {world} rank {r}");
                // Keys world - rank: the highest rank first.
                let want_rank = same.iter().rev().position(|&q| q == r).unwrap();
                assert_eq!(sub_rank, want_rank, "world {world} rank {r}");
                let want_sum: f32 = same.iter().map(|&q| q as f32 + 1.0).sum();
                assert_eq!(sum, want_sum, "world {world} rank {r}");
            }
        }
    }
);

both_backends!(
    a_hierarchical_all_reduce_matches_the_flat_one,
    gpu_nccl_a_hierarchical_all_reduce_matches_the_flat_one,
    |backend| {
        let mut rng = rng(seed("hierarchical"));
        for world in backend.worlds() {
            for per_node in (1..=world).filter(|p| world % p == 0) {
                for len in [1, 7, 1001] {
                    for op in OPS {
                        let inputs: Vec<Vec<f32>> = (0..world)
                            .map(|_| common::random_f32(&mut rng, len))
                            .collect();
                        let outs = each_rank_on(backend, world, |comm, stream| {
                            let h = comm.hierarchy(per_node).unwrap();
                            let mut buf = Buffer::from_host(stream, &inputs[comm.rank()]).unwrap();
                            h.all_reduce(stream, &mut buf, op).unwrap();
                            h.wait(stream).unwrap();
                            buf.to_host(stream).unwrap()
                        });
                        for (r, out) in outs.iter().enumerate() {
                            let what =
                                format!("world {world} nodes of {per_node} len {len} rank {r}");
                            check_reduced(&what, op, &inputs, 0, out, 1e-6, backend);
                        }
                    }
                }
            }
        }
    }
);

both_backends!(
    the_hierarchy_by_host_is_chosen_only_across_hosts,
    gpu_nccl_the_hierarchy_by_host_is_chosen_only_across_hosts,
    |backend| {
        let mut rng = rng(seed("hierarchy_by_host"));
        for world in backend.worlds() {
            let inputs: Vec<Vec<f32>> = (0..world)
                .map(|_| common::random_f32(&mut rng, 1001))
                .collect();
            // Declared hosts: interleaved pairs where the world is even, else one host.
            let outs = each_rank_on(backend, world, |comm, stream| {
                let host = if world % 2 == 0 { comm.rank() % 2 } else { 0 };
                let h = comm
                    .hierarchy_for_host(stream, &format!("host-{host}"))
                    .unwrap();
                let on_one_host = comm.hierarchy_by_host(stream).unwrap().is_none();
                let mut buf = Buffer::from_host(stream, &inputs[comm.rank()]).unwrap();
                let nodes = h.as_ref().map(|h| (h.node().world(), h.across().world()));
                match &h {
                    Some(h) => {
                        h.all_reduce(stream, &mut buf, ReduceOp::Sum).unwrap();
                        h.wait(stream).unwrap();
                    }
                    None => {
                        comm.all_reduce(stream, &mut buf, ReduceOp::Sum).unwrap();
                        comm.wait(stream).unwrap();
                    }
                }
                (nodes, on_one_host, buf.to_host(stream).unwrap())
            });
            for (r, (nodes, on_one_host, out)) in outs.iter().enumerate() {
                let want = (world % 2 == 0 && world >= 2).then_some((world / 2, 2));
                assert_eq!(*nodes, want, "world {world} rank {r}");
                assert!(on_one_host, "every rank of these tests runs on this host");
                let what = format!("world {world} rank {r} by host");
                check_reduced(&what, ReduceOp::Sum, &inputs, 0, out, 1e-6, backend);
            }
        }
    }
);

#[test]
fn a_hierarchy_needs_nodes_that_divide_the_world() {
    let outs = each_rank(group(3, PATIENT), |comm, _| comm.hierarchy(2).err());
    for e in outs {
        assert!(matches!(e, Some(Error::InvalidArgument(_))), "{e:?}");
    }
}

#[test]
fn the_tuned_bucket_size_is_one_candidate_agreed_by_every_rank_and_kept() {
    let first = each_rank(group(2, PATIENT), |comm, stream| {
        comm.tuned_bucket_bytes(stream).unwrap()
    });
    assert_eq!(first[0], first[1], "ranks agree");
    assert!(BUCKET_CANDIDATES.contains(&first[0]), "{first:?}");
    let kept = warpdrive::exec::tune::Autotuner::global()
        .records()
        .into_iter()
        .find(|r| r.kernel == "reducer-bucket-w2")
        .expect("the tuning is kept");
    assert_eq!(kept.winner, first[0].to_string());
    assert_eq!(kept.candidates.len(), BUCKET_CANDIDATES.len());
    // The next group reads the kept size: the same answer, and a reducer of that size.
    let again = each_rank(group(2, PATIENT), |comm, stream| {
        Reducer::<f32>::tuned(comm, stream).map(|_| comm.tuned_bucket_bytes(stream).unwrap())
    });
    for r in again {
        assert_eq!(r.unwrap(), first[0]);
    }
}

#[test]
fn a_reducer_needs_buckets_of_some_size() {
    let e = Reducer::<f32>::new(&Device::cpu(), 0).err().unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

#[test]
fn all_to_all_v_counts_that_disagree_fail_on_every_rank() {
    // Rank 0 expects 3 elements from rank 1, which sends 2: every rank is told, and the
    // group goes on.
    let outs = each_rank(group(2, PATIENT), |comm, stream| {
        let (send, recv) = if comm.rank() == 0 {
            ([1, 1], [1, 3])
        } else {
            ([1, 2], [1, 1])
        };
        let input = Buffer::from_host(stream, &vec![1.0f32; send.iter().sum()]).unwrap();
        let mut output = Buffer::from_host(stream, &vec![0.0f32; recv.iter().sum()]).unwrap();
        let refused = comm.all_to_all_v(stream, &input, &send, &mut output, &recv);
        let bad = comm.all_to_all_v(stream, &input, &send[..1], &mut output, &recv);
        let mut ok = Buffer::from_host(stream, &[1.0f32; 3]).unwrap();
        (
            refused,
            bad,
            comm.all_reduce(stream, &mut ok, ReduceOp::Sum),
        )
    });
    for (refused, bad, then) in outs {
        let e = refused.unwrap_err();
        assert!(is_collective(&e, "disagree"), "{e}");
        assert!(is_invalid(bad, "2 send and receive counts needed"));
        then.unwrap();
    }
}

#[test]
fn back_to_back_all_reduces_and_broadcasts_never_mix() {
    const WORLD: usize = 4;
    const STEPS: usize = 200;
    let mut rng = rng(seed("back_to_back"));
    // Step i: its length differs from its neighbours', so a step that read another's data
    // would fail on length or on values.
    let inputs: Vec<Vec<Vec<f32>>> = (0..STEPS)
        .map(|i| {
            let len = 1 + (i * 7) % 31;
            (0..WORLD)
                .map(|_| common::random_f32(&mut rng, len))
                .collect()
        })
        .collect();
    let outs = each_rank(group(WORLD, PATIENT), |comm, stream| {
        let mut outs = Vec::with_capacity(STEPS);
        for (i, step) in inputs.iter().enumerate() {
            let mut buf = Buffer::from_host(stream, &step[comm.rank()]).unwrap();
            if i % 2 == 0 {
                comm.all_reduce(stream, &mut buf, OPS[(i / 2) % 4]).unwrap();
            } else {
                comm.broadcast(stream, &mut buf, i % WORLD).unwrap();
            }
            outs.push(buf.to_host(stream).unwrap());
        }
        outs
    });
    for (rank, outs) in outs.iter().enumerate() {
        for (i, got) in outs.iter().enumerate() {
            if i % 2 == 0 {
                let what = format!("step {i} rank {rank}");
                check_reduced(
                    &what,
                    OPS[(i / 2) % 4],
                    &inputs[i],
                    0,
                    got,
                    1e-6,
                    Backend::Cpu,
                );
            } else {
                assert_eq!(got, &inputs[i][i % WORLD], "broadcast step {i} rank {rank}");
            }
        }
    }
}

#[test]
fn ranks_that_disagree_fail_on_every_rank_and_the_group_goes_on() {
    const WORLD: usize = 3;
    let mut rng = rng(seed("disagree"));
    let data: Vec<Vec<f32>> = (0..WORLD)
        .map(|_| common::random_f32(&mut rng, 7))
        .collect();
    let outs = each_rank(group(WORLD, PATIENT), |comm, stream| {
        let r = comm.rank();
        let mut errors = Vec::new();
        // A different length on rank 1.
        let mut buf = Buffer::from_host(stream, &vec![1.0f32; if r == 1 { 8 } else { 7 }]).unwrap();
        errors.push(
            comm.all_reduce(stream, &mut buf, ReduceOp::Sum)
                .unwrap_err(),
        );
        // A different op on rank 2.
        let mut buf = Buffer::from_host(stream, &[1.0f32; 7]).unwrap();
        let op = if r == 2 { ReduceOp::Max } else { ReduceOp::Sum };
        errors.push(comm.all_reduce(stream, &mut buf, op).unwrap_err());
        // A different collective on rank 0.
        let result = if r == 0 {
            comm.broadcast(stream, &mut buf, 0)
        } else {
            comm.all_reduce(stream, &mut buf, ReduceOp::Sum)
        };
        errors.push(result.unwrap_err());
        // A different root on rank 1; a different element type on rank 2.
        errors.push(
            comm.broadcast(stream, &mut buf, usize::from(r == 1))
                .unwrap_err(),
        );
        let result = if r == 2 {
            let mut ints = Buffer::from_host(stream, &[1u32; 7]).unwrap();
            comm.broadcast(stream, &mut ints, 0)
        } else {
            comm.broadcast(stream, &mut buf, 0)
        };
        errors.push(result.unwrap_err());
        // Then a call they agree on works.
        let mut buf = Buffer::from_host(stream, &data[r]).unwrap();
        comm.all_reduce(stream, &mut buf, ReduceOp::Sum).unwrap();
        (errors, buf.to_host(stream).unwrap())
    });
    for (rank, (errors, out)) in outs.iter().enumerate() {
        for e in errors {
            assert!(is_collective(e, "the ranks disagree"), "rank {rank}: {e}");
        }
        check_reduced(
            "after the errors",
            ReduceOp::Sum,
            &data,
            0,
            out,
            1e-6,
            Backend::Cpu,
        );
    }
    let first = outs[0].0[0].to_string();
    assert!(
        first.contains("rank 1: all_reduce(f32 × 8, Sum)"),
        "{first}"
    );
}

#[test]
fn send_and_recv_pass_messages_around_a_ring_in_order() {
    let mut rng = rng(seed("ring"));
    for world in 2..=4 {
        // Three messages per rank to its right neighbour, of different lengths.
        let messages: Vec<Vec<Vec<f32>>> = (0..world)
            .map(|_| {
                [3, 1, 1001]
                    .iter()
                    .map(|&n| common::random_f32(&mut rng, n))
                    .collect()
            })
            .collect();
        let outs = each_rank(group(world, PATIENT), |comm, stream| {
            let (r, w) = (comm.rank(), comm.world());
            for m in &messages[r] {
                let buf = Buffer::from_host(stream, m).unwrap();
                comm.send(stream, &buf, (r + 1) % w).unwrap();
            }
            let left = (r + w - 1) % w;
            messages[left]
                .iter()
                .map(|m| {
                    let mut buf = Buffer::from_host(stream, &vec![f32::NAN; m.len()]).unwrap();
                    comm.recv(stream, &mut buf, left).unwrap();
                    buf.to_host(stream).unwrap()
                })
                .collect::<Vec<_>>()
        });
        for (r, got) in outs.iter().enumerate() {
            assert_eq!(
                got,
                &messages[(r + world - 1) % world],
                "world {world} rank {r}"
            );
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs (and NCCL)"]
fn gpu_nccl_two_ranks_send_recv_and_a_rank_that_never_calls() {
    if Device::cuda_count() < 2 {
        eprintln!(
            "SKIPPED: needs two CUDA GPUs, this host has {}",
            Device::cuda_count()
        );
        return;
    }
    // Rank 0 sends then receives, rank 1 the other way round: NCCL runs each send when the
    // peer's stream reaches the matching receive.
    let outs = each_rank_on(Backend::Nccl, 2, |comm, stream| {
        let mine = vec![comm.rank() as f32 + 1.0; 1001];
        let out = Buffer::from_host(stream, &mine).unwrap();
        let mut got = Buffer::from_host(stream, &[f32::NAN; 1001]).unwrap();
        let peer = 1 - comm.rank();
        if comm.rank() == 0 {
            comm.send(stream, &out, peer).unwrap();
            comm.recv(stream, &mut got, peer).unwrap();
        } else {
            comm.recv(stream, &mut got, peer).unwrap();
            comm.send(stream, &out, peer).unwrap();
        }
        comm.wait(stream).unwrap();
        got.to_host(stream).unwrap()
    });
    assert_eq!(outs[0], vec![2.0f32; 1001]);
    assert_eq!(outs[1], vec![1.0f32; 1001]);

    // Rank 1 never calls: rank 0's wait fails within the timeout and aborts its side.
    let devices = [Device::cuda(0).unwrap(), Device::cuda(1).unwrap()];
    let mut comms = Comm::nccl_group(&devices, Duration::from_secs(3)).unwrap();
    let idle = comms.pop().unwrap();
    let comm = comms.pop().unwrap();
    let stream = devices[0].new_stream().unwrap();
    let mut buf = Buffer::from_host(&stream, &[1.0f32; 1 << 16]).unwrap();
    let start = std::time::Instant::now();
    // The first call connects to the peer, so the call itself may be what times out;
    // otherwise the wait does.
    let e = comm
        .all_reduce(&stream, &mut buf, ReduceOp::Sum)
        .and_then(|()| comm.wait(&stream))
        .unwrap_err();
    assert!(
        is_collective(&e, "did not finish") || is_collective(&e, "still in progress"),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
    let again = comm
        .all_reduce(&stream, &mut buf, ReduceOp::Sum)
        .unwrap_err();
    assert!(is_collective(&again, "aborted"), "{again}");
    drop(idle);
}

both_backends!(
    collectives_captured_in_a_graph_replay_on_new_data,
    gpu_nccl_collectives_captured_in_a_graph_replay_on_new_data,
    |backend| {
        use warpdrive::exec::Graph;
        let len = 1001;
        for world in backend.worlds() {
            let outs = each_rank_on(backend, world, |comm, stream| {
                let mut bufs = [
                    Buffer::from_host(stream, &vec![0.0f32; len]).unwrap(),
                    Buffer::from_host(stream, &vec![0.0f32; len * world]).unwrap(),
                ];
                // An all-reduce, then an all-gather of its result, captured once.
                let mut graph = Graph::capture_with(stream, &mut bufs, |s, [sum, all]| {
                    comm.all_reduce(s, sum, ReduceOp::Sum)?;
                    comm.all_gather(s, sum, all)
                })
                .unwrap();
                (0..3)
                    .map(|step| {
                        let mine: Vec<f32> = (0..len)
                            .map(|i| (comm.rank() * 7 + i + 100 * step) as f32)
                            .collect();
                        warpdrive::transfer::upload(stream, &mut bufs[0], &mine).unwrap();
                        graph.launch_with(&mut bufs).unwrap();
                        comm.wait(stream).unwrap();
                        (
                            bufs[0].to_host(stream).unwrap(),
                            bufs[1].to_host(stream).unwrap(),
                        )
                    })
                    .collect::<Vec<_>>()
            });
            for (r, steps) in outs.iter().enumerate() {
                for (step, (sum, all)) in steps.iter().enumerate() {
                    let want: Vec<f32> = (0..len)
                        .map(|i| (0..world).map(|q| (q * 7 + i + 100 * step) as f32).sum())
                        .collect();
                    assert_eq!(sum, &want, "world {world} rank {r} step {step}: sum");
                    let gathered: Vec<f32> = (0..world).flat_map(|_| want.clone()).collect();
                    assert_eq!(all, &gathered, "world {world} rank {r} step {step}: gather");
                }
            }
        }
    }
);
