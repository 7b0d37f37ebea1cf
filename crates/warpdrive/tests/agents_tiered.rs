//! Tiered agent populations (a GPU tier and a pinned-host tier): a tiered step equals the
//! same step over one untiered population, fields round trip in agent order across
//! migrations, birth and death counts are exact, and populations beyond the budgets are
//! errors that change nothing. One body on both backends; the GPU variants compare with
//! the CPU backend (the reference).

mod common;

use common::device_test;
use rand::Rng;
use warpdrive::agents::{Population, StepFn, StepInputs, TierBudget, TieredPopulation};
use warpdrive::{Device, Error, Stream};

const BIG: usize = 1 << 30;

fn stream(dev: &Device) -> Stream {
    dev.new_stream().expect("a stream")
}

/// A step that uses the agent's global index, the population's count, an input indexed by
/// the agent and u32 arithmetic (exact on both backends).
fn indexed() -> StepFn {
    StepFn::new(
        "indexed",
        "x[i] = x[i] + v[i] * p[0] + w[i % w_len] * p[2]; \
         if (x[i] > p[1]) { x[i] = p[1]; hits[i] += 1u; } \
         id[i] = id[i] * 3u + (u32)(i ^ n);",
        |i, f, p| {
            let w = f.inputs_f32[0];
            f.f32[0][i] = f.f32[0][i] + f.f32[1][i] * p[0] + w[i % w.len()] * p[2];
            if f.f32[0][i] > p[1] {
                f.f32[0][i] = p[1];
                f.u32[0][i] += 1;
            }
            let n = f.u32[1].len();
            f.u32[1][i] = f.u32[1][i].wrapping_mul(3).wrapping_add((i ^ n) as u32);
        },
    )
}

struct Agents {
    x: Vec<f32>,
    v: Vec<f32>,
    hits: Vec<u32>,
    id: Vec<u32>,
}

fn agents(rng: &mut impl Rng, n: usize) -> Agents {
    Agents {
        x: (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
        v: (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
        hits: (0..n).map(|_| rng.random_range(0..5)).collect(),
        id: (0..n).map(|_| rng.random()).collect(),
    }
}

fn tiered(s: &Stream, a: &Agents, budget: TierBudget, chunk: usize) -> TieredPopulation {
    let mut t = TieredPopulation::with_chunk(a.x.len(), budget, chunk).unwrap();
    t.add_f32(s, "x", &a.x).unwrap();
    t.add_f32(s, "v", &a.v).unwrap();
    t.add_u32(s, "hits", &a.hits).unwrap();
    t.add_u32(s, "id", &a.id).unwrap();
    t
}

fn untiered(s: &Stream, a: &Agents) -> Population {
    let mut p = Population::new(a.x.len());
    p.add_f32(s, "x", &a.x).unwrap();
    p.add_f32(s, "v", &a.v).unwrap();
    p.add_u32(s, "hits", &a.hits).unwrap();
    p.add_u32(s, "id", &a.id).unwrap();
    p
}

/// (agents, GPU budget, host budget, chunk): GPU budget 1000 with 3001 agents in chunks
/// that do not divide the parked 2001; all parked; none parked; exactly the GPU budget;
/// empty; one agent; a chunk size far above the parked count (the staging holds what is
/// parked, not the chunk size); a larger one in many uneven chunks.
const CASES: [(usize, usize, usize, usize); 8] = [
    (3001, 1000, BIG, 700),
    (3001, 0, BIG, 512),
    (3001, 5000, 0, 512),
    (1000, 1000, 0, 300),
    (0, 10, 10, 4),
    (1, 0, 1, 1),
    (5, 2, 10, usize::MAX),
    ((1 << 18) + 3, 40_000, BIG, 65_537),
];

fn tiered_step_matches_untiered(dev: &Device) {
    let s = stream(dev);
    let cpu = stream(&Device::cpu());
    let mut rng = common::rng(common::seed("tiered_step_matches_untiered"));
    let step = indexed();
    let params = [0.75, 0.5, 0.25];
    for (n, gpu, host, chunk) in CASES {
        let a = agents(&mut rng, n);
        let w: Vec<f32> = (0..97).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut got = tiered(&s, &a, TierBudget::new(gpu, host), chunk);
        assert_eq!(got.gpu_len(), n.min(gpu), "n={n}");
        assert_eq!(got.parked_len(), n - n.min(gpu), "n={n}");
        assert_eq!(got.chunks(), got.parked_len().div_ceil(chunk));
        let mut want = untiered(&cpu, &a);
        let (mut gin, mut win) = (StepInputs::new(), StepInputs::new());
        gin.add_f32(&s, "w", &w).unwrap();
        win.add_f32(&cpu, "w", &w).unwrap();
        for _ in 0..3 {
            step.run_tiered(&s, &mut got, &gin, &params).unwrap();
            step.run_with(&cpu, &mut want, &win, &params).unwrap();
        }
        let case = format!("n={n} gpu={gpu} chunk={chunk}");
        // u32 arithmetic on the global index and count: exact on both backends.
        assert_eq!(
            got.u32_to_host(&s, "id").unwrap(),
            want.u32_to_host(&cpu, "id").unwrap(),
            "{case}: id"
        );
        let (gx, wx) = (
            got.f32_to_host(&s, "x").unwrap(),
            want.f32_to_host(&cpu, "x").unwrap(),
        );
        let (gh, wh) = (
            got.u32_to_host(&s, "hits").unwrap(),
            want.u32_to_host(&cpu, "hits").unwrap(),
        );
        assert_eq!(
            got.f32_to_host(&s, "v").unwrap(),
            a.v,
            "{case}: v unchanged"
        );
        if dev.is_cuda() {
            // As `step_matches_cpu`: one FMA rounding apart per step at most, and a value
            // within a rounding of the cap may count a hit on one side only.
            for (i, (g, w)) in gx.iter().zip(&wx).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                    "{case}: agent {i}: {g} vs {w}"
                );
            }
            let differ = gh.iter().zip(&wh).filter(|(a, b)| a != b).count();
            assert!(
                differ <= n / 10_000 + 1,
                "{case}: {differ} hit counts differ"
            );
        } else {
            assert_eq!(gx, wx, "{case}: x");
            assert_eq!(gh, wh, "{case}: hits");
        }
    }
    // The step's checks hold for a tiered population too.
    let a = agents(&mut rng, 10);
    let mut t = tiered(&s, &a, TierBudget::new(4, 10), 3);
    assert!(matches!(
        step.run_tiered(&s, &mut t, &StepInputs::new(), &[0.0; 9]),
        Err(Error::InvalidArgument(m)) if m.contains("constants")
    ));
    let mut clash = StepInputs::new();
    clash.add_f32(&s, "x", &[1.0]).unwrap();
    assert!(matches!(
        step.run_tiered(&s, &mut t, &clash, &[]),
        Err(Error::InvalidArgument(m)) if m.contains("clashes")
    ));
}
device_test!(
    cpu_tiered_step_matches_untiered,
    gpu_tiered_step_matches_untiered,
    tiered_step_matches_untiered
);

fn assert_holds(s: &Stream, t: &TieredPopulation, a: &Agents, what: &str) {
    assert_eq!(t.len(), a.x.len(), "{what}");
    assert_eq!(t.gpu_len() + t.parked_len(), t.len(), "{what}");
    assert_eq!(t.f32_to_host(s, "x").unwrap(), a.x, "{what}: x");
    assert_eq!(t.f32_to_host(s, "v").unwrap(), a.v, "{what}: v");
    assert_eq!(t.u32_to_host(s, "hits").unwrap(), a.hits, "{what}: hits");
    assert_eq!(t.u32_to_host(s, "id").unwrap(), a.id, "{what}: id");
}

fn tiered_fields_and_migration(dev: &Device) {
    let s = stream(dev);
    let mut rng = common::rng(common::seed("tiered_fields_and_migration"));
    let n = 3001;
    let a = agents(&mut rng, n);
    let mut t = tiered(&s, &a, TierBudget::new(1000, 2500), 700);
    assert_eq!(
        t.fields(),
        [
            ("x", warpdrive::agents::FieldKind::F32),
            ("v", warpdrive::agents::FieldKind::F32),
            ("hits", warpdrive::agents::FieldKind::U32),
            ("id", warpdrive::agents::FieldKind::U32),
        ]
    );
    assert_holds(&s, &t, &a, "built");
    // Park everything (short chunks before the old ones), unpark everything, park part,
    // unpark all but the last two (a chunk taken in part), park one, re-chunk: order kept
    // every time, and a step that uses the global index still matches one population.
    let mix = StepFn::new("mix", "id[i] = id[i] * 3u + (u32)(i ^ n);", |i, f, _| {
        let n = f.u32[1].len();
        f.u32[1][i] = f.u32[1][i].wrapping_mul(3).wrapping_add((i ^ n) as u32);
    });
    let cpu = stream(&Device::cpu());
    let mut reference = untiered(&cpu, &a);
    let mut a = a;
    for (gpu, host, chunks) in [
        (0, n, 5),
        (n, 0, 0),
        (1234, 5000, 3),
        (2999, 2, 1),
        (2998, 3, 2),
    ] {
        t.set_budget(&s, TierBudget::new(gpu, host)).unwrap();
        let what = format!("budget {gpu}/{host}");
        assert_eq!(t.gpu_len(), gpu.min(n), "{what}");
        assert_eq!(t.gpu().len(), gpu.min(n), "{what}");
        assert_eq!(t.chunks(), chunks, "{what}");
        assert_eq!(t.budget(), TierBudget::new(gpu, host));
        assert_holds(&s, &t, &a, &what);
        mix.run_tiered(&s, &mut t, &StepInputs::new(), &[]).unwrap();
        mix.run(&cpu, &mut reference, &[]).unwrap();
        a.id = reference.u32_to_host(&cpu, "id").unwrap();
        assert_holds(&s, &t, &a, &format!("{what}, stepped"));
    }
    t.set_chunk(&s, 1).unwrap();
    assert_eq!((t.chunk(), t.chunks()), (1, 3));
    assert_holds(&s, &t, &a, "chunk 1");
    t.set_budget(&s, TierBudget::new(2998, 3)).unwrap();
    assert_holds(&s, &t, &a, "the same budget again");
    // A step after a migration sees the moved agents (the staging is rebuilt or kept).
    let bump = StepFn::new("bump", "hits[i] += 1u;", |i, f, _| f.u32[0][i] += 1);
    t.set_budget(&s, TierBudget::new(500, 3000)).unwrap();
    bump.run_tiered(&s, &mut t, &StepInputs::new(), &[])
        .unwrap();
    let mut b = Agents {
        hits: a.hits.iter().map(|h| h + 1).collect(),
        ..agents(&mut rng, 0)
    };
    b.x = a.x.clone();
    b.v = a.v.clone();
    b.id = a.id.clone();
    assert_holds(&s, &t, &b, "stepped after a migration");

    // Over the budgets: a clear error naming the budget and the excess, nothing changed.
    match TieredPopulation::new(3001, TierBudget::new(1000, 1500)) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("host budget is exceeded by 501"), "{m}")
        }
        other => panic!("expected a budget error, got {other:?}"),
    }
    match t.set_budget(&s, TierBudget::new(1000, 2000)) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("exceeded by 1"), "{m}")
        }
        other => panic!("expected a budget error, got {other:?}"),
    }
    assert_eq!(t.budget(), TierBudget::new(500, 3000));
    assert_holds(&s, &t, &b, "after a refused budget");
    assert!(TieredPopulation::new(0, TierBudget::new(0, 0)).is_ok());
    assert!(TieredPopulation::new(1, TierBudget::new(0, 0)).is_err());
    assert!(TieredPopulation::new(usize::MAX, TierBudget::new(usize::MAX, usize::MAX)).is_ok());
    // More one-agent chunks than the host can list: an error, not an abort.
    assert!(TieredPopulation::with_chunk(usize::MAX, TierBudget::new(0, usize::MAX), 1).is_err());
    assert!(TieredPopulation::with_chunk(3, TierBudget::new(1, 5), 0).is_err());
    assert!(t.set_chunk(&s, 0).is_err());

    // Bad lengths, names and kinds: errors that change nothing.
    assert!(matches!(t.add_f32(&s, "y", &vec![0.0; n + 1]),
        Err(Error::InvalidArgument(m)) if m.contains(&format!("{} values", n + 1))));
    assert!(matches!(t.add_f32(&s, "x", &a.x),
        Err(Error::InvalidArgument(m)) if m.contains("already")));
    for bad in ["bad name", "1x", "n", "", "p3"] {
        assert!(matches!(
            t.add_u32(&s, bad, &a.id),
            Err(Error::InvalidArgument(_))
        ));
    }
    assert_eq!(t.fields().len(), 4);
    assert!(matches!(t.u32_to_host(&s, "x"), Err(Error::InvalidArgument(m)) if m.contains("kind")));
    assert!(
        matches!(t.f32_to_host(&s, "nope"), Err(Error::InvalidArgument(m)) if m.contains("nope"))
    );
    assert_holds(&s, &t, &b, "after refused fields");
}
device_test!(
    cpu_tiered_fields_and_migration,
    gpu_tiered_fields_and_migration,
    tiered_fields_and_migration
);

fn tiered_birth_and_death(dev: &Device) {
    let s = stream(dev);
    let cpu = stream(&Device::cpu());
    let mut rng = common::rng(common::seed("tiered_birth_and_death"));
    for (n, gpu, host, chunk) in CASES {
        let xs = common::random_f32(&mut rng, n);
        let alive: Vec<u32> = (0..n).map(|_| u32::from(rng.random_bool(0.7))).collect();
        let births: Vec<u32> = (0..n).map(|_| rng.random_range(0..6)).collect();
        let ids: Vec<u32> = (0..n as u32).collect();
        // Room for every child: the budgets grow by what life can add at most.
        let budget = TierBudget::new(gpu, host.saturating_add(3 * n));
        let mut t = TieredPopulation::with_chunk(n, budget, chunk).unwrap();
        let mut p = Population::new(n);
        for (name, v) in [("id", &ids), ("alive", &alive), ("kids", &births)] {
            t.add_u32(&s, name, v).unwrap();
            p.add_u32(&cpu, name, v).unwrap();
        }
        t.add_f32(&s, "x", &xs).unwrap();
        p.add_f32(&cpu, "x", &xs).unwrap();
        let got = t.apply_life(&s, "alive", "kids", 3).unwrap();
        let want = p.apply_life(&cpu, "alive", "kids", 3).unwrap();
        let case = format!("n={n} gpu={gpu} chunk={chunk}");
        assert_eq!(got, want, "{case}: counts");
        assert_eq!(t.len(), p.len(), "{case}");
        assert_eq!(t.gpu_len(), p.len().min(gpu), "{case}: GPU first");
        for f in ["id", "alive", "kids"] {
            assert_eq!(
                t.u32_to_host(&s, f).unwrap(),
                p.u32_to_host(&cpu, f).unwrap(),
                "{case}: {f}"
            );
        }
        assert_eq!(
            t.f32_to_host(&s, "x").unwrap(),
            p.f32_to_host(&cpu, "x").unwrap(),
            "{case}: x"
        );
    }
    // Life that would pass the budgets: an error naming the excess, no agent dropped.
    let mut t = TieredPopulation::with_chunk(6, TierBudget::new(2, 5), 2).unwrap();
    t.add_u32(&s, "alive", &[1, 1, 0, 1, 1, 1]).unwrap();
    t.add_u32(&s, "kids", &[0, 2, 1, 0, 0, 0]).unwrap();
    t.add_f32(&s, "x", &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    match t.apply_life(&s, "alive", "kids", 3) {
        Err(Error::InvalidArgument(m)) => {
            assert!(
                m.contains("exceeded by 1") && m.contains("3 children"),
                "{m}"
            )
        }
        other => panic!("expected a budget error, got {other:?}"),
    }
    assert_eq!(t.len(), 6, "a refused life changes nothing");
    assert_eq!(t.u32_to_host(&s, "kids").unwrap(), [0, 2, 1, 0, 0, 0]);
    // With one child fewer it fits: 5 survivors + 2 children = 7, 2 on the GPU, 5 parked.
    let got = t.apply_life(&s, "alive", "kids", 1).unwrap();
    assert_eq!((got.survived, got.died, got.born), (5, 1, 2));
    assert_eq!((t.gpu_len(), t.parked_len()), (2, 5));
    assert_eq!(
        t.f32_to_host(&s, "x").unwrap(),
        [0.0, 1.0, 3.0, 4.0, 5.0, 1.0, 2.0]
    );
    assert!(t.apply_life(&s, "x", "kids", 1).is_err());
    assert!(t.apply_life(&s, "kids", "kids", 1).is_err());
    assert!(t.apply_life(&s, "alive", "nope", 1).is_err());
}
device_test!(
    cpu_tiered_birth_and_death,
    gpu_tiered_birth_and_death,
    tiered_birth_and_death
);

#[test]
fn a_tiered_population_moves_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TieredPopulation>();
    send_sync::<Population>();
}
