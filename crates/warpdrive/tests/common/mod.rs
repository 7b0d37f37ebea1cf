//! Shared by the integration tests: devices, the macro that runs a body on both backends,
//! fresh random inputs, tolerances, and (by being included) a private `XDG_CACHE_HOME`.
#![allow(dead_code)]

pub mod actor;
pub mod cache_home;
pub mod crash;
pub mod mlp;
pub mod moe;
pub mod ranks;
pub mod tier;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warpdrive::Device;

/// One test body on both backends, in the manner of candle's `test_device!`:
/// `device_test!(cpu_name, gpu_name, body)` defines the test `cpu_name`, which runs
/// `body(&Device::cpu())`, and `gpu_name`, ignored without a GPU, which runs `body(&cuda())`.
/// `body` is a `fn(&Device)`: a function, or a closure that captures nothing. Both names are
/// spelled out, as stable Rust cannot build an identifier from parts; the GPU one starts with
/// `gpu_` (the bundle's `run.sh` sanitizes `gpu_*`, and `gpu_smem_*` for shared memory too).
#[allow(unused_macros)] // not every test file has a body for both backends
macro_rules! device_test {
    ($(#[$attr:meta])* $cpu:ident, $gpu:ident, $body:expr $(,)?) => {
        $(#[$attr])*
        #[test]
        fn $cpu() {
            let body: fn(&::warpdrive::Device) = $body;
            body(&::warpdrive::Device::cpu());
        }

        $(#[$attr])*
        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn $gpu() {
            let body: fn(&::warpdrive::Device) = $body;
            body(&$crate::common::cuda());
        }
    };
}
#[allow(unused_imports)]
pub(crate) use device_test;

/// An in-process CPU group of `world` ranks (the `dist` tests).
pub fn group(world: usize, timeout: std::time::Duration) -> Vec<warpdrive::dist::Comm> {
    warpdrive::dist::Comm::local_group(world, timeout).expect("a local group")
}

/// Runs `body` on one thread per rank, each with its own CPU stream; results in rank order.
pub fn each_rank<R: Send>(
    comms: Vec<warpdrive::dist::Comm>,
    body: impl Fn(&warpdrive::dist::Comm, &warpdrive::Stream) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let stream = Device::cpu().new_stream().expect("a CPU stream");
                    body(&comm, &stream)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// A port free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    free_ports::<1>()[0]
}

/// `N` distinct ports free a moment ago: each listener is held until all are picked, so the
/// OS cannot hand the same port out twice.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<_> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|k| held[k].local_addr().unwrap().port())
}

/// Whether `e` is a collective's error whose message holds `needle`.
pub fn is_collective(e: &warpdrive::Error, needle: &str) -> bool {
    matches!(e, warpdrive::Error::Collective { .. }) && e.to_string().contains(needle)
}

/// Whether `result` is an `InvalidArgument` whose message holds `needle`.
pub fn is_invalid(result: warpdrive::Result<()>, needle: &str) -> bool {
    matches!(&result, Err(warpdrive::Error::InvalidArgument(m)) if m.contains(needle))
}

/// The sizes every op is checked at: empty, one, odd, and a large odd size.
pub const SIZES: [usize; 4] = [0, 1, 1023, (1 << 20) + 3];

/// CUDA device 0; GPU tests are `#[ignore]`d, so reaching here without one is a failure.
/// Logs go to the test's output when `WARPDRIVE_LOG` is set (e.g. `warpdrive=debug`).
pub fn cuda() -> Device {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("WARPDRIVE_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    }
    match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => panic!("GPU test run without a usable CUDA device: {e}"),
    }
}

/// A fresh seed (or `WARPDRIVE_TEST_SEED`), printed so a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed: u64 = std::env::var("WARPDRIVE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{test}: seed {seed} (set WARPDRIVE_TEST_SEED to replay)");
    seed
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in [-1, 1), never all zero.
pub fn random_f32(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

pub fn random_f64(rng: &mut StdRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-1.0f64..1.0)).collect()
}

/// The float types the kernels take, with their DESIGN.md tolerance (relative to the
/// magnitude of the terms) and the spacing of their subnormals (an absolute floor).
pub trait TestFloat: warpdrive::Float {
    const NAME: &'static str;
    const TOL: f64;
    const TINY: f64;
    fn of(v: f32) -> Self;
}
impl TestFloat for f32 {
    const NAME: &'static str = "f32";
    const TOL: f64 = 1e-6;
    const TINY: f64 = 1.401298464324817e-45;
    fn of(v: f32) -> Self {
        v
    }
}
impl TestFloat for half::f16 {
    const NAME: &'static str = "f16";
    const TOL: f64 = 1e-3;
    const TINY: f64 = 5.960464477539063e-8;
    fn of(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}
impl TestFloat for half::bf16 {
    const NAME: &'static str = "bf16";
    const TOL: f64 = 1e-2;
    const TINY: f64 = 9.183549615799121e-41;
    fn of(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

/// `n` values uniform in [lo, hi), rounded to `T`.
pub fn random_in<T: TestFloat>(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<T> {
    (0..n).map(|_| T::of(rng.random_range(lo..hi))).collect()
}

/// A buffer of `n` copies of `poison` (NaN for floats, 0xff.. for integers), so elements an
/// op fails to write stand out.
pub fn poisoned<T: warpdrive::DType>(
    stream: &warpdrive::Stream,
    n: usize,
    poison: T,
) -> warpdrive::Buffer<T> {
    warpdrive::Buffer::from_host(stream, &vec![poison; n]).unwrap()
}

/// NaN of `T`.
pub fn nan<T: TestFloat>() -> T {
    T::of(f32::NAN)
}

/// Same value, or both NaN.
pub fn same_or_both_nan(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

/// `tracing` output written while `f` runs on this thread. One process-wide subscriber writes
/// each event into the capture of the thread that emits it (none: dropped): a subscriber
/// scoped to the thread lost events now and then to tracing's interest cache, which other
/// tests' threads fill concurrently.
pub fn warnings_during(f: impl FnOnce()) -> String {
    use std::cell::RefCell;
    use std::sync::Once;
    thread_local! {
        static CAPTURE: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
    }
    struct ThisThread;
    impl std::io::Write for ThisThread {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            CAPTURE.with(|c| {
                if let Some(out) = c.borrow_mut().as_mut() {
                    out.extend_from_slice(buf);
                }
            });
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(|| ThisThread)
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other global tracing subscriber in a test binary");
    });
    CAPTURE.with(|c| *c.borrow_mut() = Some(Vec::new()));
    f();
    let text = CAPTURE.with(|c| c.borrow_mut().take()).unwrap_or_default();
    String::from_utf8_lossy(&text).into_owned()
}
