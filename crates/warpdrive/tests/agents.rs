//! GPU agents: populations, step functions, the spatial grid, Circles and the majority vote,
//! one body on both backends (the GPU variants compare with the CPU backend, the reference),
//! and the generated kernels compiled through the real NVRTC (no GPU).

mod common;

use common::device_test;
use rand::Rng;
use warpdrive::agents::{
    submit, Averaging, Circles, CirclesConfig, FieldKind, GridShape, HostField, Majority,
    MoveKernel, Population, Quorum, ResidentMajority, ResidentQuorum, SpatialGrid, StepFn,
    StepInputs,
};
use warpdrive::kernels::{Arch, PtxCache};
use warpdrive::{Buffer, Device, Error};

/// Odd sizes: empty, one, a few warps and a bit, and a large odd one.
const SIZES: [usize; 4] = [0, 1, 1023, (1 << 18) + 3];

fn stream(dev: &Device) -> warpdrive::Stream {
    dev.new_stream().expect("a stream")
}

fn population_round_trip(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("population_round_trip"));
    for n in SIZES {
        let xs = common::random_f32(&mut rng, n);
        let ids: Vec<u32> = (0..n).map(|_| rng.random()).collect();
        let mut p = Population::new(n);
        p.add_f32(&s, "x", &xs).unwrap();
        p.add_u32(&s, "id", &ids).unwrap();
        assert_eq!(p.len(), n);
        assert_eq!(p.fields(), [("x", FieldKind::F32), ("id", FieldKind::U32)]);
        assert_eq!(p.f32_to_host(&s, "x").unwrap(), xs);
        assert_eq!(p.u32_to_host(&s, "id").unwrap(), ids);
        // Bad sizes, names and kinds are errors naming what was asked.
        let short = vec![0.0f32; n + 1];
        assert!(matches!(p.add_f32(&s, "y", &short),
            Err(Error::InvalidArgument(m)) if m.contains(&format!("{} values", n + 1))));
        assert!(
            matches!(p.add_f32(&s, "x", &xs), Err(Error::InvalidArgument(m)) if m.contains("already"))
        );
        for bad in ["bad name", "1x", "n", "", "p3"] {
            let got = p.add_u32(&s, bad, &ids);
            assert!(matches!(got, Err(Error::InvalidArgument(_))), "{bad}");
        }
        assert!(matches!(p.u32("x"), Err(Error::InvalidArgument(m)) if m.contains("kind")));
        assert!(matches!(p.f32("nope"), Err(Error::InvalidArgument(m)) if m.contains("nope")));
    }
}
device_test!(
    cpu_population_round_trip,
    gpu_population_round_trip,
    population_round_trip
);

fn drift() -> StepFn {
    StepFn::new(
        "drift",
        "x[i] = x[i] + v[i] * p[0]; if (x[i] > p[1]) { x[i] = p[1]; hits[i] += 1u; }",
        |i, f, p| {
            f.f32[0][i] += f.f32[1][i] * p[0];
            if f.f32[0][i] > p[1] {
                f.f32[0][i] = p[1];
                f.u32[0][i] += 1;
            }
        },
    )
}

fn step_matches_cpu(dev: &Device) {
    let s = stream(dev);
    let cpu = stream(&Device::cpu());
    let mut rng = common::rng(common::seed("step_matches_cpu"));
    let step = drift();
    for n in SIZES {
        let x = common::random_f32(&mut rng, n);
        let v = common::random_f32(&mut rng, n);
        let hits: Vec<u32> = (0..n).map(|_| rng.random_range(0..5)).collect();
        let build = |st: &warpdrive::Stream| {
            let mut p = Population::new(n);
            p.add_f32(st, "x", &x).unwrap();
            p.add_f32(st, "v", &v).unwrap();
            p.add_u32(st, "hits", &hits).unwrap();
            p
        };
        let (mut got, mut want) = (build(&s), build(&cpu));
        for _ in 0..3 {
            step.run(&s, &mut got, &[0.75, 0.5]).unwrap();
            step.run(&cpu, &mut want, &[0.75, 0.5]).unwrap();
        }
        // f32 multiply-add: both sides round the same operations (contracted to an FMA on
        // the GPU at most, one rounding apart per step).
        let (gx, wx) = (
            got.f32_to_host(&s, "x").unwrap(),
            want.f32_to_host(&cpu, "x").unwrap(),
        );
        for (i, (a, b)) in gx.iter().zip(&wx).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "agent {i}: {a} vs {b}"
            );
        }
        let gh = got.u32_to_host(&s, "hits").unwrap();
        let wh = want.u32_to_host(&cpu, "hits").unwrap();
        let differ = gh.iter().zip(&wh).filter(|(a, b)| a != b).count();
        // A value within an FMA rounding of the cap may count on one side only.
        assert!(differ <= n / 10_000 + 1, "{differ} hit counts differ");
        assert!(n < 2 || wh.iter().any(|&h| h > 0));
    }
    let mut p = Population::new(2);
    p.add_f32(&s, "x", &[1.0, 2.0]).unwrap();
    assert!(
        matches!(step.run(&s, &mut p, &[0.0; 9]), Err(Error::InvalidArgument(m)) if m.contains("constants"))
    );
}
device_test!(cpu_step_matches_cpu, gpu_step_matches_cpu, step_matches_cpu);

fn grid_is_a_counting_sort(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("grid_is_a_counting_sort"));
    let shape = GridShape::new(-5.0, 5.5, 2.0).unwrap();
    assert_eq!(shape.dim, 6);
    for n in SIZES {
        // Some positions outside the cube (clamped into its edge bins) and a NaN.
        let mut pos: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..n).map(|_| rng.random_range(-7.0f32..8.0)).collect())
            .collect();
        if n > 0 {
            pos[1][n / 2] = f32::NAN;
        }
        let bufs: Vec<Buffer<f32>> = pos
            .iter()
            .map(|p| Buffer::from_host(&s, p).unwrap())
            .collect();
        let mut grid = SpatialGrid::new(&s, shape, n).unwrap();
        // Rebuilt twice: the second must not see the first's counts.
        for _ in 0..2 {
            grid.rebuild(&s, &bufs[0], &bufs[1], &bufs[2]).unwrap();
        }
        let starts = grid.starts_to_host(&s).unwrap();
        let mid = grid.messages_to_host(&s).unwrap();
        assert_eq!(starts.len(), shape.bins() + 1);
        assert_eq!(starts[shape.bins()] as usize, n);
        let mut seen = vec![false; n];
        for b in 0..shape.bins() {
            assert!(starts[b] <= starts[b + 1]);
            for &m in &mid[starts[b] as usize..starts[b + 1] as usize] {
                let m = m as usize;
                assert!(!seen[m], "agent {m} twice");
                seen[m] = true;
                assert_eq!(shape.bin(pos[0][m], pos[1][m], pos[2][m]) as usize, b);
            }
        }
        assert!(seen.iter().all(|&v| v));
    }
    assert!(matches!(
        GridShape::new(0.0, 1.0, 0.0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        GridShape::new(0.0, 1e9, 1.0),
        Err(Error::InvalidArgument(_))
    ));
    let b = Buffer::from_host(&s, &[0.0f32; 3]).unwrap();
    let mut grid = SpatialGrid::new(&s, shape, 4).unwrap();
    assert!(matches!(
        grid.rebuild(&s, &b, &b, &b),
        Err(Error::InvalidArgument(_))
    ));
}
device_test!(
    cpu_grid_is_a_counting_sort,
    gpu_grid_is_a_counting_sort,
    grid_is_a_counting_sort
);

/// One Circles step on `dev` against the CPU step from the same positions. The model is
/// chaotic, so steps are compared, not trajectories. Tolerance: 1e-4 absolute on positions
/// of magnitude ≤ W/2 (the move is ≤ 0.05 per axis: f32 force sums in another order than the
/// f64 reference, sinf / cbrtf within an ulp or two); agents whose neighbor sits within
/// rounding of the radius (counted on one side only) may differ by up to the repulsion
/// factor 0.05: at most 1 in 10 000 of them.
/// Both GPU move kernels (`MoveKernel::Fast`, the default, and `Exact`) are held to it.
fn circles_step_matches_cpu(dev: &Device) {
    let s = stream(dev);
    let cpu = stream(&Device::cpu());
    let seed = common::seed("circles_step_matches_cpu");
    for (n, kernel) in [0, 1, 2, 4099, 50_001]
        .into_iter()
        .flat_map(|n| [(n, MoveKernel::Fast), (n, MoveKernel::Exact)])
    {
        let config = CirclesConfig::new(n, seed);
        let mut got = Circles::new(&s, config).unwrap();
        got.set_move_kernel(kernel);
        let mut want = Circles::new(&cpu, config).unwrap();
        // Two steps from the same state: the first, then the second from the CPU's state.
        for round in 0..2 {
            got.step(&s).unwrap();
            want.step(&cpu).unwrap();
            let mut outliers = 0;
            for axis in ["x", "y", "z"] {
                let g = got.population().f32_to_host(&s, axis).unwrap();
                let w = want.population().f32_to_host(&cpu, axis).unwrap();
                for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                    let d = (a - b).abs();
                    assert!(
                        d <= 0.05 + 1e-5,
                        "{kernel:?} round {round} agent {i} {axis}: {a} vs {b}"
                    );
                    if d > 1e-4 {
                        outliers += 1;
                    }
                }
            }
            assert!(
                outliers <= n / 10_000,
                "{kernel:?}: {outliers} outliers of {n}"
            );
            let (x, y, z) = (
                want.population().f32_to_host(&cpu, "x").unwrap(),
                want.population().f32_to_host(&cpu, "y").unwrap(),
                want.population().f32_to_host(&cpu, "z").unwrap(),
            );
            got = Circles::from_positions(&s, config, &x, &y, &z).unwrap();
            got.set_move_kernel(kernel);
        }
    }
}
device_test!(
    cpu_circles_step_matches_cpu,
    gpu_circles_step_matches_cpu,
    circles_step_matches_cpu
);

/// One step replayed from a captured graph (one graph launch per step) against the same
/// step launched eagerly from the same positions (tolerance as above: the order of messages
/// within a bin follows the atomics on a GPU).
fn circles_graph_step_matches_eager(dev: &Device) {
    let s = stream(dev);
    let seed = common::seed("circles_graph_step_matches_eager");
    let n = 20_011;
    let config = CirclesConfig::new(n, seed);
    let mut eager = Circles::new(&s, config).unwrap();
    let mut graphed = Circles::new(&s, config).unwrap();
    {
        let mut graph = warpdrive::exec::Graph::capture(&s, |st| graphed.step(st)).unwrap();
        // The capture ran nothing on a GPU (it recorded); one launch is one step.
        graph.launch().unwrap();
    }
    eager.step(&s).unwrap();
    let mut outliers = 0;
    for axis in ["x", "y", "z"] {
        let g = graphed.population().f32_to_host(&s, axis).unwrap();
        let e = eager.population().f32_to_host(&s, axis).unwrap();
        for (i, (a, b)) in g.iter().zip(&e).enumerate() {
            let d = (a - b).abs();
            assert!(d <= 0.05 + 1e-5, "agent {i} {axis}: {a} vs {b}");
            if d > 1e-4 {
                outliers += 1;
            }
        }
    }
    assert!(outliers <= n / 10_000, "{outliers} outliers of {n}");
}
device_test!(
    cpu_circles_graph_step_matches_eager,
    gpu_circles_graph_step_matches_eager,
    circles_graph_step_matches_eager
);

#[test]
fn circles_is_deterministic_on_the_cpu_for_a_seed() {
    let cpu = stream(&Device::cpu());
    let run = |seed: u64| {
        let mut sim = Circles::new(&cpu, CirclesConfig::new(3001, seed)).unwrap();
        for _ in 0..3 {
            sim.step(&cpu).unwrap();
        }
        let mut bits = Vec::new();
        for axis in ["x", "y", "z"] {
            let v = sim.population().f32_to_host(&cpu, axis).unwrap();
            bits.extend(v.iter().map(|f| f.to_bits()));
        }
        bits
    };
    let seed = common::seed("circles_is_deterministic_on_the_cpu_for_a_seed");
    let a = run(seed);
    assert_eq!(a, run(seed));
    assert_ne!(a, run(seed ^ 1));
}

/// At density 1 with bins of 2 over a cube of 20 (10 bins a side), an agent reads the
/// messages of the bins around it: on average (2.8 bins per axis)³ · 8 volume ≈ 175.6.
#[test]
fn circles_reads_the_expected_messages() {
    let cpu = stream(&Device::cpu());
    let seed = common::seed("circles_reads_the_expected_messages");
    let mut sim = Circles::new(&cpu, CirclesConfig::new(8000, seed)).unwrap();
    assert_eq!(sim.config().width, 20.0);
    assert_eq!(sim.grid().shape().dim, 10);
    sim.step(&cpu).unwrap();
    let per_agent = sim.messages_read().unwrap() as f64 / 8000.0;
    let want = 2.8f64.powi(3) * 8.0;
    assert!(
        (per_agent - want).abs() < 0.03 * want,
        "{per_agent} vs {want}"
    );
}

/// Both ways of publishing the decision: the packed word (the default) and the fenced words.
fn majority_vote(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("majority_vote"));
    let mut vote = Majority::new(&s).unwrap();
    let sizes = SIZES.into_iter().chain([2, 64, 3 * 256 * 132 + 5]);
    for (n, packed) in sizes.flat_map(|n| [(n, true), (n, false)]) {
        vote.set_packed(packed);
        // First an all-yes vote, so a stale decision would show in the next.
        let all = Buffer::from_host(&s, &vec![9u32; n]).unwrap();
        vote.run(&s, &all).unwrap();
        let d = vote.decision(&s).unwrap();
        assert_eq!((d.yes, d.voters, d.passed), (n as u64, n as u64, n > 0));
        for p in [0.3, 0.5, 0.7] {
            let v: Vec<u32> = (0..n)
                .map(|_| {
                    if rng.random_bool(p) {
                        rng.random_range(1..u32::MAX)
                    } else {
                        0
                    }
                })
                .collect();
            let yes = v.iter().filter(|&&x| x != 0).count() as u64;
            let votes = Buffer::from_host(&s, &v).unwrap();
            vote.run(&s, &votes).unwrap();
            let d = vote.decision(&s).unwrap();
            assert_eq!(d.yes, yes, "n {n} p {p}");
            assert_eq!(d.passed, 2 * yes > n as u64);
        }
        // An exact tie is not a majority.
        if n % 2 == 0 {
            let v: Vec<u32> = (0..n).map(|i| (i % 2) as u32).collect();
            vote.run(&s, &Buffer::from_host(&s, &v).unwrap()).unwrap();
            assert!(!vote.decision(&s).unwrap().passed);
        }
    }
}
device_test!(cpu_majority_vote, gpu_smem_majority_vote, majority_vote);

fn birth_and_death(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("birth_and_death"));
    for n in SIZES {
        let xs = common::random_f32(&mut rng, n);
        let alive: Vec<u32> = (0..n).map(|_| u32::from(rng.random_bool(0.7))).collect();
        // Up to 5 children asked, 3 allowed: the clamp is part of what is checked.
        let births: Vec<u32> = (0..n).map(|_| rng.random_range(0..6)).collect();
        let mut p = Population::new(n);
        p.add_f32(&s, "x", &xs).unwrap();
        p.add_u32(&s, "id", &(0..n as u32).collect::<Vec<_>>())
            .unwrap();
        p.add_u32(&s, "alive", &alive).unwrap();
        p.add_u32(&s, "kids", &births).unwrap();
        let got = p.apply_life(&s, "alive", "kids", 3).unwrap();
        let mut want: Vec<usize> = (0..n).filter(|&i| alive[i] != 0).collect();
        let survived = want.len();
        for (i, &b) in births.iter().enumerate() {
            want.extend(std::iter::repeat_n(i, b.min(3) as usize));
        }
        assert_eq!(
            (got.survived, got.died, got.born),
            (survived, n - survived, want.len() - survived),
            "n={n}"
        );
        assert_eq!(p.len(), want.len());
        let ids: Vec<u32> = want.iter().map(|&i| i as u32).collect();
        assert_eq!(p.u32_to_host(&s, "id").unwrap(), ids, "n={n}: order");
        let x: Vec<f32> = want.iter().map(|&i| xs[i]).collect();
        assert_eq!(p.f32_to_host(&s, "x").unwrap(), x, "n={n}: copies");
        assert!(p.u32_to_host(&s, "alive").unwrap().iter().all(|&a| a == 1));
        assert!(p.u32_to_host(&s, "kids").unwrap().iter().all(|&b| b == 0));
    }
    // Fields that are not u32, the same field twice, or a size that may pass 2^32: errors.
    let mut p = Population::new(3);
    p.add_f32(&s, "x", &[1.0, 2.0, 3.0]).unwrap();
    p.add_u32(&s, "a", &[1, 1, 1]).unwrap();
    assert!(p.apply_life(&s, "x", "a", 1).is_err());
    assert!(p.apply_life(&s, "a", "a", 1).is_err());
    assert!(p.apply_life(&s, "a", "nope", 1).is_err());
    let mut p = Population::new(3);
    p.add_u32(&s, "a", &[1, 1, 1]).unwrap();
    p.add_u32(&s, "b", &[0, 0, 0]).unwrap();
    assert!(matches!(
        p.apply_life(&s, "a", "b", u32::MAX),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(p.len(), 3, "a refused call changes nothing");
}
device_test!(
    cpu_birth_and_death,
    gpu_smem_birth_and_death,
    birth_and_death
);

fn weighted_quorum(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("weighted_quorum"));
    let mut vote = Quorum::new(&s).unwrap();
    for n in SIZES {
        let votes: Vec<u32> = (0..n).map(|_| rng.random_range(0..3)).collect();
        let weights: Vec<f32> = (0..n).map(|_| rng.random_range(0.0..2.0)).collect();
        let yes: f64 = votes
            .iter()
            .zip(&weights)
            .filter(|(v, _)| **v != 0)
            .map(|(_, w)| f64::from(*w))
            .sum();
        let all: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        let (vb, wb) = (
            Buffer::from_host(&s, &votes).unwrap(),
            Buffer::from_host(&s, &weights).unwrap(),
        );
        for quorum in [0.25, 0.5, 2.0 / 3.0, 0.9] {
            vote.run(&s, &vb, &wb, quorum).unwrap();
            let d = vote.decision(&s).unwrap();
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
            assert!(close(d.yes_weight, yes), "n={n}: {} vs {yes}", d.yes_weight);
            assert!(
                close(d.total_weight, all),
                "n={n}: {} vs {all}",
                d.total_weight
            );
            if (yes - quorum * all).abs() > 1e-6 * all.max(1.0) {
                assert_eq!(
                    d.passed,
                    all > 0.0 && yes >= quorum * all,
                    "n={n} q={quorum}"
                );
            }
        }
    }
    let (vb, wb) = (
        Buffer::from_host(&s, &[1u32, 0]).unwrap(),
        Buffer::from_host(&s, &[1.0f32]).unwrap(),
    );
    assert!(vote.run(&s, &vb, &wb, 0.5).is_err(), "lengths differ");
    let wb = Buffer::from_host(&s, &[1.0f32, 1.0]).unwrap();
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(vote.run(&s, &vb, &wb, bad).is_err(), "quorum {bad}");
    }
}
device_test!(
    cpu_weighted_quorum,
    gpu_smem_weighted_quorum,
    weighted_quorum
);

fn iterative_averaging(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("iterative_averaging"));
    let mut avg = Averaging::new(&s).unwrap();
    for n in SIZES {
        let xs: Vec<f32> = (0..n).map(|_| rng.random_range(-50.0..50.0)).collect();
        let mean = xs.iter().map(|&v| f64::from(v)).sum::<f64>() / n.max(1) as f64;
        let spread0 = xs
            .iter()
            .map(|&v| (f64::from(v) - mean).abs())
            .fold(0.0, f64::max);
        // The spread halves a round at rate 0.5: about log2(spread0 / tol) rounds.
        let tol = 1e-2f32;
        let want_rounds = if spread0 <= f64::from(tol) {
            0.0
        } else {
            (spread0 / f64::from(tol)).log2().ceil()
        };
        let mut x = Buffer::from_host(&s, &xs).unwrap();
        avg.run(&s, &mut x, 0.5, tol, 200).unwrap();
        let o = avg.outcome(&s).unwrap();
        assert!(o.converged, "n={n}: {o:?}");
        assert!(
            (o.rounds as f64 - want_rounds).abs() <= 1.0,
            "n={n}: {o:?} vs {want_rounds}"
        );
        assert!((o.mean - mean).abs() <= 1e-3, "n={n}: {o:?} vs {mean}");
        let after = x.to_host(&s).unwrap();
        for v in &after {
            assert!(
                (f64::from(*v) - o.mean).abs() <= f64::from(tol) + 1e-4,
                "n={n}: {v}"
            );
        }
        // Too few rounds for a tolerance of 0: not converged, every round applied.
        if spread0 > 0.0 {
            let mut x = Buffer::from_host(&s, &xs).unwrap();
            avg.run(&s, &mut x, 0.5, 0.0, 2).unwrap();
            let o = avg.outcome(&s).unwrap();
            assert!(!o.converged && o.rounds == 2, "n={n}: {o:?}");
        }
    }
    let mut x = Buffer::from_host(&s, &[1.0f32]).unwrap();
    for (rate, tol) in [(0.0, 0.1), (1.5, 0.1), (0.5, -1.0), (f32::NAN, 0.1)] {
        assert!(avg.run(&s, &mut x, rate, tol, 10).is_err(), "{rate} {tol}");
    }
}
device_test!(
    cpu_iterative_averaging,
    gpu_smem_iterative_averaging,
    iterative_averaging
);

fn job_submission(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("job_submission"));
    let n = 1023;
    let (x, v) = (
        common::random_f32(&mut rng, n),
        common::random_f32(&mut rng, n),
    );
    let hits = vec![0u32; n];
    let fields = [
        ("x", HostField::F32(&x)),
        ("v", HostField::F32(&v)),
        ("hits", HostField::U32(&hits)),
    ];
    let job = submit(&s, n, &fields, &drift(), &[0.5, 0.25]).unwrap();
    let mut want = Population::new(n);
    let cpu = Device::cpu().new_stream().unwrap();
    want.add_f32(&cpu, "x", &x).unwrap();
    want.add_f32(&cpu, "v", &v).unwrap();
    want.add_u32(&cpu, "hits", &hits).unwrap();
    drift().run(&cpu, &mut want, &[0.5, 0.25]).unwrap();
    let got = job.population.f32_to_host(&s, "x").unwrap();
    for (g, w) in got.iter().zip(want.f32_to_host(&cpu, "x").unwrap()) {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
    }
    assert_eq!(
        job.population.u32_to_host(&s, "hits").unwrap(),
        want.u32_to_host(&cpu, "hits").unwrap()
    );
    let t = job.times;
    assert!(t.total >= t.load + t.upload + t.first_step - std::time::Duration::from_micros(1));
    // A field of the wrong length is refused before anything runs.
    let short = [("x", HostField::F32(&x[..3]))];
    assert!(matches!(
        submit(&s, n, &short, &drift(), &[]),
        Err(Error::InvalidArgument(_))
    ));
}
device_test!(cpu_job_submission, gpu_job_submission, job_submission);

/// Every agent pulls toward the mean of all messages (brute force) and adds its graph
/// neighbours' values (edges): the same body on both backends, compared with the CPU.
fn messages_and_edges(dev: &Device) {
    let s = stream(dev);
    let cpu = Device::cpu().new_stream().unwrap();
    let mut rng = common::rng(common::seed("messages_and_edges"));
    let step = StepFn::new(
        "pull",
        "float m = 0.0f; for (u64 j = 0; j < msg_x_len; ++j) m += msg_x[j]; \
         m /= (float)msg_x_len; x[i] += p[0] * (m - msg_x[i]); \
         float s = 0.0f; for (u32 e = edge_start[i]; e < edge_start[i + 1]; ++e) \
         s += msg_x[edge_to[e]]; nsum[i] = s;",
        |i, f, p| {
            let (mx, start, to) = (f.inputs_f32[0], f.inputs_u32[0], f.inputs_u32[1]);
            let mut m = 0.0f32;
            for v in mx {
                m += v;
            }
            m /= mx.len() as f32;
            f.f32[0][i] += p[0] * (m - mx[i]);
            let mut s = 0.0f32;
            for e in start[i]..start[i + 1] {
                s += mx[to[e as usize] as usize];
            }
            f.f32[1][i] = s;
        },
    );
    for n in [1usize, 33, 1023] {
        let x = common::random_f32(&mut rng, n);
        let edges: Vec<(u32, u32)> = (0..3 * n)
            .map(|_| (rng.random_range(0..n as u32), rng.random_range(0..n as u32)))
            .collect();
        let run = |st: &warpdrive::Stream| {
            let mut p = Population::new(n);
            p.add_f32(st, "x", &x).unwrap();
            p.add_f32(st, "nsum", &vec![f32::NAN; n]).unwrap();
            let mut inputs = StepInputs::new();
            inputs.messages(st, &p, &["x"]).unwrap();
            inputs.edges(st, n, &edges).unwrap();
            step.run_with(st, &mut p, &inputs, &[0.5]).unwrap();
            (
                p.f32_to_host(st, "x").unwrap(),
                p.f32_to_host(st, "nsum").unwrap(),
            )
        };
        let (gx, gs) = run(&s);
        let (wx, ws) = run(&cpu);
        for (g, w) in gx.iter().zip(&wx).chain(gs.iter().zip(&ws)) {
            // The mean's sum runs in one order on both; FMA contraction on the GPU aside.
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                "n={n}: {g} vs {w}"
            );
        }
    }
    // Bad graphs and names are errors.
    let mut inputs = StepInputs::new();
    assert!(inputs.edges(&s, 2, &[(0, 2)]).is_err());
    assert!(inputs.add_f32(&s, "n", &[1.0]).is_err());
    inputs.add_f32(&s, "x", &[1.0]).unwrap();
    assert!(inputs.add_f32(&s, "x", &[1.0]).is_err());
    let mut p = Population::new(1);
    p.add_f32(&s, "x", &[1.0]).unwrap();
    assert!(
        step.run_with(&s, &mut p, &inputs, &[]).is_err(),
        "input named as a field"
    );
}
device_test!(
    cpu_messages_and_edges,
    gpu_messages_and_edges,
    messages_and_edges
);

fn persistent_steps(dev: &Device) {
    let s = stream(dev);
    let cpu = Device::cpu().new_stream().unwrap();
    let mut rng = common::rng(common::seed("persistent_steps"));
    for n in SIZES {
        let x = common::random_f32(&mut rng, n);
        let v = common::random_f32(&mut rng, n);
        let make = |st: &warpdrive::Stream| {
            let mut p = Population::new(n);
            p.add_f32(st, "x", &x).unwrap();
            p.add_f32(st, "v", &v).unwrap();
            p.add_u32(st, "hits", &vec![0; n]).unwrap();
            p
        };
        let (mut on_dev, mut want) = (make(&s), make(&cpu));
        let none = StepInputs::new();
        drift()
            .run_steps(&s, &mut on_dev, &none, &[0.25, 0.5], 7)
            .unwrap();
        for _ in 0..7 {
            drift().run(&cpu, &mut want, &[0.25, 0.5]).unwrap();
        }
        let got = on_dev.f32_to_host(&s, "x").unwrap();
        for (g, w) in got.iter().zip(want.f32_to_host(&cpu, "x").unwrap()) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "n={n}: {g} vs {w}"
            );
        }
        let hits = on_dev.u32_to_host(&s, "hits").unwrap();
        let want_hits = want.u32_to_host(&cpu, "hits").unwrap();
        let differ = hits.iter().zip(&want_hits).filter(|(a, b)| a != b).count();
        assert!(
            differ <= n / 1000,
            "n={n}: {differ} agents hit the clamp a different number of times"
        );
    }
}
device_test!(cpu_persistent_steps, gpu_persistent_steps, persistent_steps);

/// Sizes of the resident vote's tests: none, one, a few blocks and a bit, a large odd one.
const RESIDENT_SIZES: [usize; 4] = [0, 1, 1000 + 7, (1 << 20) + 3];

/// A vote's timeout in these tests: long enough for a kernel under compute-sanitizer.
const SANITIZED: std::time::Duration = std::time::Duration::from_secs(60);

/// Fresh votes, about `percent` % yes (any non-zero value is a yes).
fn some_votes(rng: &mut impl Rng, n: usize, percent: u32) -> Vec<u32> {
    (0..n)
        .map(|_| {
            if rng.random_range(0..100) < percent {
                rng.random_range(1..=u32::MAX)
            } else {
                0
            }
        })
        .collect()
}

fn resident_majority(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("resident_majority"));
    for n in RESIDENT_SIZES {
        let first = some_votes(&mut rng, n, 50);
        let mut vote = ResidentMajority::start(&s, Buffer::from_host(&s, &first).unwrap()).unwrap();
        vote.set_timeout(SANITIZED);
        assert!(vote.is_running());
        // Many rounds in a row, the votes rewritten before most (the odd ones vote again on
        // the same votes: a decision that did not move must still be answered).
        let mut votes = first;
        for round in 0..40 {
            if round % 2 == 0 {
                let percent = [0, 100, 49, 50, 51, 10, 90][round / 2 % 7];
                votes = some_votes(&mut rng, n, percent);
                vote.votes_mut()
                    .unwrap()
                    .copy_from_host(&s, &votes)
                    .unwrap();
            }
            let yes = votes.iter().filter(|&&v| v != 0).count() as u64;
            let d = vote.vote().unwrap();
            assert_eq!(
                (d.yes, d.voters, d.passed),
                (yes, n as u64, 2 * yes > n as u64),
                "n={n} round {round}"
            );
        }
        // Stopped: a vote is an error at once, not a wait; a second stop is a no-op.
        vote.stop().unwrap();
        assert!(!vote.is_running());
        vote.stop().unwrap();
        vote.set_timeout(std::time::Duration::from_millis(200));
        let t0 = std::time::Instant::now();
        assert!(vote.vote().is_err(), "n={n}: a stopped vote answered");
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        vote.set_timeout(SANITIZED);
        // Restarted: answers again, on votes changed while it was stopped.
        votes = some_votes(&mut rng, n, 60);
        vote.votes_mut()
            .unwrap()
            .copy_from_host(&s, &votes)
            .unwrap();
        vote.restart().unwrap();
        assert!(vote.restart().is_err(), "a second start while running");
        for _ in 0..3 {
            let yes = votes.iter().filter(|&&v| v != 0).count() as u64;
            assert_eq!(vote.vote().unwrap().yes, yes, "n={n} after a restart");
        }
        if dev.ordinal().is_some() {
            // One resident kernel at a time on a GPU, and no persistent stepper beside it.
            let other = Buffer::from_host(&s, &[1u32]).unwrap();
            assert!(ResidentMajority::start(&s, other).is_err());
            let mut p = Population::new(1);
            p.add_f32(&s, "x", &[0.0]).unwrap();
            p.add_f32(&s, "v", &[1.0]).unwrap();
            let steps = drift().run_steps(&s, &mut p, &StepInputs::new(), &[1.0], 2);
            assert!(matches!(steps, Err(Error::Unsupported(_))), "{steps:?}");
            assert!(vote.blocks() >= 1);
        }
        drop(vote);
    }
}
device_test!(
    cpu_resident_majority,
    gpu_smem_resident_majority,
    resident_majority
);

fn resident_quorum(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("resident_quorum"));
    for n in RESIDENT_SIZES {
        let votes = some_votes(&mut rng, n, 50);
        let weights: Vec<f32> = (0..n).map(|_| rng.random_range(0.0..2.0)).collect();
        let mut vote = ResidentQuorum::start(
            &s,
            Buffer::from_host(&s, &votes).unwrap(),
            Buffer::from_host(&s, &weights).unwrap(),
            2.0 / 3.0,
        )
        .unwrap();
        vote.set_timeout(SANITIZED);
        for round in 0..12 {
            let votes = some_votes(&mut rng, n, [30, 66, 67, 90][round % 4]);
            let weights: Vec<f32> = (0..n).map(|_| rng.random_range(0.0..2.0)).collect();
            vote.votes_mut()
                .unwrap()
                .copy_from_host(&s, &votes)
                .unwrap();
            vote.weights_mut()
                .unwrap()
                .copy_from_host(&s, &weights)
                .unwrap();
            let yes: f64 = votes
                .iter()
                .zip(&weights)
                .filter(|(v, _)| **v != 0)
                .map(|(_, w)| f64::from(*w))
                .sum();
            let all: f64 = weights.iter().map(|&w| f64::from(w)).sum();
            let d = vote.vote().unwrap();
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
            assert!(close(d.yes_weight, yes), "n={n}: {} vs {yes}", d.yes_weight);
            assert!(
                close(d.total_weight, all),
                "n={n}: {} vs {all}",
                d.total_weight
            );
            if (yes - 2.0 / 3.0 * all).abs() > 1e-6 * all.max(1.0) {
                assert_eq!(d.passed, all > 0.0 && yes >= 2.0 / 3.0 * all, "n={n}");
            }
        }
        vote.stop().unwrap();
        assert!(vote.vote().is_err());
    }
    let (vb, wb) = (
        Buffer::from_host(&s, &[1u32, 0]).unwrap(),
        Buffer::from_host(&s, &[1.0f32]).unwrap(),
    );
    assert!(
        ResidentQuorum::start(&s, vb, wb, 0.5).is_err(),
        "lengths differ"
    );
    for bad in [-0.1, 1.5, f64::NAN] {
        let (vb, wb) = (
            Buffer::from_host(&s, &[1u32]).unwrap(),
            Buffer::from_host(&s, &[1.0f32]).unwrap(),
        );
        assert!(
            ResidentQuorum::start(&s, vb, wb, bad).is_err(),
            "quorum {bad}"
        );
    }
}
device_test!(
    cpu_resident_quorum,
    gpu_smem_resident_quorum,
    resident_quorum
);

fn temp_cache(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("wd-agents-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn step_functions_compile_with_nvrtc() {
    let dir = temp_cache("step");
    let cache = PtxCache::at(&dir);
    let fields = [
        ("x", FieldKind::F32),
        ("v", FieldKind::F32),
        ("hits", FieldKind::U32),
    ];
    let ptx = drift().ptx(&cache, &fields, Arch::SM_90A).unwrap();
    for k in ["agents_step", "agents_step_range", "agents_step_loop"] {
        assert!(ptx.contains(&format!(".entry {k}(")), "{k}");
    }
    // A step with inputs: messages and a graph's edges.
    let pull = StepFn::new(
        "pull",
        "float s = 0.0f; for (u32 e = edge_start[i]; e < edge_start[i + 1]; ++e) \
         s += msg_x[edge_to[e]]; x[i] = s / (float)msg_x_len;",
        |_, _, _| {},
    );
    let inputs = [
        ("msg_x", FieldKind::F32),
        ("edge_start", FieldKind::U32),
        ("edge_to", FieldKind::U32),
    ];
    let ptx = pull
        .ptx_with(&cache, &[("x", FieldKind::F32)], &inputs, Arch::SM_90A)
        .unwrap();
    assert!(ptx.contains(".entry agents_step_range("));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn a_step_that_does_not_compile_returns_the_nvrtc_log() {
    let dir = temp_cache("broken");
    let cache = PtxCache::at(&dir);
    let broken = StepFn::new("broken", "x[i] = no_such_name;", |_, _, _| {});
    match broken.ptx(&cache, &[("x", FieldKind::F32)], Arch::SM_90A) {
        Err(Error::Compile { log, .. }) => assert!(log.contains("no_such_name"), "{log}"),
        other => panic!("expected a compile error, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn the_agents_kernels_compile_with_nvrtc() {
    let dir = temp_cache("kernels");
    let cache = PtxCache::at(&dir);
    for arch in warpdrive::kernels::AGENTS.archs().unwrap() {
        let ptx = cache.compile(&warpdrive::kernels::AGENTS, arch).unwrap();
        for k in [
            "agents_bin_count",
            "agents_scatter",
            "circles_move",
            "circles_move_fast",
            "agents_vote",
        ] {
            assert!(ptx.contains(&format!(".entry {k}")), "{k} for {arch}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
