//! Work launched from the device: a dispatcher that routes a queue of requests to prepared
//! graphs without the host.
//!
//! Each target is a [`Graph`] captured for one size bucket (requests up to its bound) and
//! instantiated for launch from the device. [`Dispatcher::run`] copies the requests to the
//! device and launches one graph; from there the device routes every request to the graph of
//! its bucket (`kernels/device_launch.cu`), with no host work until the queue is done:
//!
//! - Several requests a round (`per_round` > 1): the dispatcher's kernel launches targets
//!   fire-and-forget, taking requests in order until `per_round` of them, a target already
//!   launched in this round (a graph cannot run twice at once) or the end of the queue; then
//!   it relaunches itself as its own tail launch, which starts when the round and everything
//!   it launched have finished. Requests in one round run concurrently, rounds in order.
//! - One request a round (`per_round` = 1, targets that share buffers): chained. Each target
//!   ends with the dispatcher's kernel, which takes the next request and launches its target
//!   as the tail launch of the graph it runs in: one launch a request, started when the
//!   previous target ends (bench/NOTES.md: a dispatcher relaunched between targets costs a
//!   second launch a request).
//!
//! CUDA's rules shape this: device launches come only from kernels running in a graph, tail
//! launches start when their parent ends (a never-ending loop could not use them), and a
//! device graph cannot be relaunched while it runs.
//!
//! Each target starts with a kernel that stamps its start, so a run reports the latency from
//! each decision to the start of the work it launched; the run's launch count and those
//! latencies go to the `metrics` facade (`warpdrive_device_launches_total`,
//! `warpdrive_device_launch_seconds`).
//!
//! On the CPU backend the dispatcher makes the same decisions ([`Dispatcher::decide`], the
//! reference the GPU's are checked against) and runs the targets' recorded bodies in order.

use std::ffi::c_void;

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::kernels::DEVICE_LAUNCH;
use crate::memory::Buffer;

use super::graph::Graph;
use super::launch::{launch, Kernel, LaunchConfig};

/// The most targets a dispatcher routes to (the kernel keeps a 64-bit mask of the targets a
/// round launched); also the most requests one round takes.
pub const MAX_TARGETS: usize = 64;

/// The most requests one run takes (a decision packs its round in 24 bits).
pub const MAX_REQUESTS: usize = 1 << 24;

/// Words of the dispatcher's state: count, head, round, fired, status (`DispatchState`).
const STATE_WORDS: usize = 5;

/// What the dispatcher decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The target (bucket) launched.
    pub target: usize,
    /// The round it was launched in (0 first).
    pub round: u32,
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchReport {
    /// One decision per request, in queue order.
    pub decisions: Vec<Decision>,
    /// Rounds the run took (executions of the dispatcher graph).
    pub rounds: u32,
    /// Per request, nanoseconds from the decision to the start of the graph it launched
    /// (`%globaltimer`); empty on the CPU backend.
    pub latency_ns: Vec<u64>,
}

/// Routes queues of requests to prepared graphs from the device (see the module docs).
pub struct Dispatcher<'a> {
    stream: Stream,
    capacity: usize,
    per_round: usize,
    bounds: Vec<u32>,
    targets: Vec<Graph<'a>>,
    /// CUDA only: the device side (absent on the CPU backend).
    gpu: Option<DeviceSide>,
}

impl std::fmt::Debug for Dispatcher<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Dispatcher({} targets, {} requests at most, {:?})",
            self.targets.len(),
            self.capacity,
            self.stream
        )
    }
}

impl DeviceSide {
    fn new(stream: &Stream, capacity: usize) -> Result<DeviceSide> {
        let device = stream.device();
        Ok(DeviceSide {
            started: Kernel::new(device, &DEVICE_LAUNCH, "dl_started")?,
            dispatch: Kernel::new(device, &DEVICE_LAUNCH, "dl_dispatch")?,
            chain: Kernel::new(device, &DEVICE_LAUNCH, "dl_chain")?,
            requests: Buffer::zeros(stream, capacity)?,
            bounds: Buffer::zeros(stream, MAX_TARGETS)?,
            handles: Buffer::zeros(stream, MAX_TARGETS)?,
            state: Buffer::zeros(stream, STATE_WORDS)?,
            slots: Buffer::zeros(stream, MAX_TARGETS)?,
            decisions: Buffer::zeros(stream, capacity)?,
            decided: Buffer::zeros(stream, capacity)?,
            starts: Buffer::zeros(stream, capacity)?,
            sealed: None,
            staging: vec![0; capacity],
        })
    }
}

/// The dispatcher's device memory and its own graph.
struct DeviceSide {
    started: Kernel,
    dispatch: Kernel,
    chain: Kernel,
    requests: Buffer<u32>,
    /// The targets' bounds, padded with `u32::MAX` to [`MAX_TARGETS`] (filled at the seal).
    bounds: Buffer<u32>,
    /// The targets' device-launch handles (filled at the seal).
    handles: Buffer<u64>,
    state: Buffer<u32>,
    slots: Buffer<u32>,
    decisions: Buffer<u32>,
    decided: Buffer<u64>,
    starts: Buffer<u64>,
    /// Built when the first run seals the target list.
    sealed: Option<Sealed>,
    /// Host staging of the requests (the queue is copied whole).
    staging: Vec<u32>,
}

struct Sealed {
    /// The graph a run starts with (the dispatcher's kernel alone).
    graph: Graph<'static>,
}

/// The device addresses and shapes the dispatcher's kernels take.
#[derive(Clone, Copy)]
struct Tables {
    requests: u64,
    bounds: u64,
    handles: u64,
    state: u64,
    slots: u64,
    decisions: u64,
    decided: u64,
}

impl DeviceSide {
    fn tables(&self) -> Tables {
        Tables {
            requests: self.requests.device_ptr(),
            bounds: self.bounds.device_ptr(),
            handles: self.handles.device_ptr(),
            state: self.state.device_ptr(),
            slots: self.slots.device_ptr(),
            decisions: self.decisions.device_ptr(),
            decided: self.decided.device_ptr(),
        }
    }
}

/// Enqueues the dispatcher's kernel on `s`: `dl_chain` (one request, launched as the tail of
/// the graph this runs in) without `per_round`, else `dl_dispatch`.
fn launch_dispatcher(s: &Stream, kernel: &Kernel, t: Tables, per_round: Option<u32>) -> Result<()> {
    let Tables {
        mut requests,
        mut bounds,
        mut handles,
        mut state,
        mut slots,
        mut decisions,
        mut decided,
    } = t;
    let mut buckets = MAX_TARGETS as u32;
    let mut per_round_value = per_round.unwrap_or(1);
    let mut params: Vec<*mut c_void> = vec![
        (&mut requests as *mut u64).cast(),
        (&mut bounds as *mut u64).cast(),
        (&mut handles as *mut u64).cast(),
        (&mut buckets as *mut u32).cast(),
    ];
    if per_round.is_some() {
        params.push((&mut per_round_value as *mut u32).cast());
    }
    params.extend([
        (&mut state as *mut u64).cast::<c_void>(),
        (&mut slots as *mut u64).cast(),
        (&mut decisions as *mut u64).cast(),
        (&mut decided as *mut u64).cast(),
    ]);
    // SAFETY: dl_dispatch(requests, bounds, targets, buckets, per_round, state, slots,
    // decisions, decided) / dl_chain (the same without per_round), with the types in that
    // order: `requests`, `decisions` and `decided` hold the dispatcher's capacity (the
    // state's count never exceeds it), `bounds`, `targets` and `slots` MAX_TARGETS entries
    // (= buckets), `state` its five words; all owned by the dispatcher, which outlives every
    // graph that runs this kernel.
    unsafe { launch(s, kernel, LaunchConfig::linear(1, 32), &mut params) }
}

impl<'a> Dispatcher<'a> {
    /// A dispatcher on `stream` for queues of up to `capacity` requests, launching at most
    /// `per_round` of them concurrently (1 when the targets share buffers).
    pub fn new(stream: &Stream, capacity: usize, per_round: usize) -> Result<Self> {
        if capacity == 0 || capacity > MAX_REQUESTS {
            return Err(Error::InvalidArgument(format!(
                "a dispatcher takes 1 to {MAX_REQUESTS} requests a run, not {capacity}"
            )));
        }
        if per_round == 0 || per_round > MAX_TARGETS {
            return Err(Error::InvalidArgument(format!(
                "a dispatcher round launches 1 to {MAX_TARGETS} graphs, not {per_round}"
            )));
        }
        let gpu = stream.run(
            (),
            |()| Ok(None),
            |(), _| DeviceSide::new(stream, capacity).map(Some),
        )?;
        Ok(Dispatcher {
            stream: stream.clone(),
            capacity,
            per_round,
            bounds: Vec::new(),
            targets: Vec::new(),
            gpu,
        })
    }

    /// Adds the target for requests up to `bound` (above the previous target's bound):
    /// captures what `body` enqueues on the dispatcher's stream as a graph launched from the
    /// device. Refused once a run has sealed the targets, past [`MAX_TARGETS`], and for work
    /// the device cannot launch.
    pub fn add_target(
        &mut self,
        bound: u32,
        mut body: impl FnMut(&Stream) -> Result<()> + 'a,
    ) -> Result<usize> {
        let index = self.targets.len();
        if index == MAX_TARGETS {
            return Err(Error::InvalidArgument(format!(
                "a dispatcher routes to at most {MAX_TARGETS} targets"
            )));
        }
        if self.bounds.last().is_some_and(|&b| bound <= b) {
            return Err(Error::InvalidArgument(format!(
                "target bounds must increase: {bound} after {:?}",
                self.bounds.last()
            )));
        }
        let graph = match &self.gpu {
            None => Graph::capture(&self.stream, body)?,
            Some(g) if g.sealed.is_some() => {
                return Err(Error::InvalidArgument(
                    "targets are added before the first run".into(),
                ))
            }
            Some(g) => {
                let started = g.started.clone();
                let starts = g.starts.device_ptr();
                let slot = g.slots.device_ptr() + 4 * index as u64;
                let capacity = self.capacity as u32;
                // Chained (one request a round): the target ends by launching the next.
                let chain = (self.per_round == 1).then(|| (g.chain.clone(), g.tables()));
                let mut graph = Graph::capture(&self.stream, move |s| {
                    let (mut starts, mut slot, mut capacity) = (starts, slot, capacity);
                    let mut params = [
                        (&mut starts as *mut u64).cast::<c_void>(),
                        (&mut slot as *mut u64).cast(),
                        (&mut capacity as *mut u32).cast(),
                    ];
                    // SAFETY: dl_started(u64* starts, const u32* slot, u32 capacity): `starts`
                    // holds `capacity` stamps and `slot` is one word of the dispatcher's slot
                    // array, both owned by the dispatcher, which outlives its targets.
                    unsafe { launch(s, &started, LaunchConfig::linear(1, 32), &mut params)? };
                    body(s)?;
                    match &chain {
                        Some((kernel, tables)) => launch_dispatcher(s, kernel, *tables, None),
                        None => Ok(()),
                    }
                })?;
                graph.prepare_device_launch()?;
                graph
            }
        };
        self.bounds.push(bound);
        self.targets.push(graph);
        Ok(index)
    }

    /// The targets' bounds, in order.
    pub fn bounds(&self) -> &[u32] {
        &self.bounds
    }

    /// The decisions a run over `requests` makes (the reference: both backends decide so).
    pub fn decide(&self, requests: &[u32]) -> Result<Vec<Decision>> {
        self.check_requests(requests)?;
        Ok(decide(requests, &self.bounds, self.per_round))
    }

    fn check_requests(&self, requests: &[u32]) -> Result<()> {
        let Some(&top) = self.bounds.last() else {
            return Err(Error::InvalidArgument(
                "a dispatcher with no targets".into(),
            ));
        };
        if requests.len() > self.capacity {
            return Err(Error::InvalidArgument(format!(
                "{} requests for a dispatcher of {}",
                requests.len(),
                self.capacity
            )));
        }
        if let Some((i, r)) = requests.iter().enumerate().find(|(_, &r)| r > top) {
            return Err(Error::InvalidArgument(format!(
                "request {i} is {r}, above the largest target's bound {top}"
            )));
        }
        Ok(())
    }

    /// Routes `requests` and waits for everything launched: [`start`](Self::start) then
    /// [`finish`](Self::finish).
    pub fn run(&mut self, requests: &[u32]) -> Result<DispatchReport> {
        self.start(requests)?;
        self.finish(requests)
    }

    /// Enqueues a run over `requests` on the dispatcher's stream (on the CPU backend: runs
    /// the targets now, in decision order). One host launch for the whole queue.
    pub fn start(&mut self, requests: &[u32]) -> Result<()> {
        self.check_requests(requests)?;
        let Some(g) = &mut self.gpu else {
            for d in decide(requests, &self.bounds, self.per_round) {
                self.targets[d.target].launch()?;
            }
            return Ok(());
        };
        if g.sealed.is_none() {
            let sealed = seal(
                g,
                &self.stream,
                &mut self.targets,
                &self.bounds,
                self.per_round,
            )?;
            g.sealed = Some(sealed);
        }
        g.staging[..requests.len()].copy_from_slice(requests);
        g.requests.driver_copy_from_host(&self.stream, &g.staging)?;
        let state = [requests.len() as u32, 0, 0, 0, 0];
        g.state.driver_copy_from_host(&self.stream, &state)?;
        if let Some(sealed) = &mut g.sealed {
            sealed.graph.launch()?;
        }
        Ok(())
    }

    /// Waits for the run [`start`](Self::start)ed over `requests` and reads what it did; a
    /// launch the device refused is an error with the runtime's code.
    pub fn finish(&mut self, requests: &[u32]) -> Result<DispatchReport> {
        let Some(g) = &self.gpu else {
            let decisions = decide(requests, &self.bounds, self.per_round);
            let rounds = decisions.last().map_or(0, |d| d.round + 1);
            return Ok(DispatchReport {
                decisions,
                rounds,
                latency_ns: Vec::new(),
            });
        };
        let n = requests.len();
        let mut state = [0u32; STATE_WORDS];
        g.state.driver_copy_to_host(&self.stream, &mut state)?;
        let [_, head, rounds, fired, status] = state;
        if status != 0 {
            return Err(Error::Unsupported(format!(
                "a launch from the device failed with cudaError {} after {fired} launches",
                status as i32
            )));
        }
        if head as usize != n {
            return Err(Error::InvalidArgument(format!(
                "the dispatcher took {head} of {n} requests"
            )));
        }
        let mut packed = vec![0u32; self.capacity];
        let mut decided = vec![0u64; self.capacity];
        let mut starts = vec![0u64; self.capacity];
        g.decisions.driver_copy_to_host(&self.stream, &mut packed)?;
        g.decided.driver_copy_to_host(&self.stream, &mut decided)?;
        g.starts.driver_copy_to_host(&self.stream, &mut starts)?;
        let decisions = packed[..n]
            .iter()
            .map(|&p| Decision {
                target: (p & 0xff) as usize,
                round: p >> 8,
            })
            .collect();
        let latency_ns: Vec<u64> = (0..n)
            .map(|i| starts[i].saturating_sub(decided[i]))
            .collect();
        metrics::counter!("warpdrive_device_launches_total").increment(fired as u64);
        let histogram = metrics::histogram!("warpdrive_device_launch_seconds");
        latency_ns
            .iter()
            .for_each(|&ns| histogram.record(ns as f64 * 1e-9));
        Ok(DispatchReport {
            decisions,
            rounds,
            latency_ns,
        })
    }
}

/// Fills the device tables and captures the graph a run starts with (made launchable from the
/// device: `dl_dispatch` relaunches it).
fn seal(
    g: &mut DeviceSide,
    stream: &Stream,
    targets: &mut [Graph<'_>],
    bounds: &[u32],
    per_round: usize,
) -> Result<Sealed> {
    if targets.is_empty() {
        return Err(Error::InvalidArgument(
            "a dispatcher with no targets".into(),
        ));
    }
    let mut handles = vec![0u64; MAX_TARGETS];
    for (h, t) in handles.iter_mut().zip(targets.iter_mut()) {
        *h = t.prepare_device_launch()?;
    }
    let mut padded = vec![u32::MAX; MAX_TARGETS];
    padded[..bounds.len()].copy_from_slice(bounds);
    g.bounds.driver_copy_from_host(stream, &padded)?;
    g.handles.driver_copy_from_host(stream, &handles)?;
    let tables = g.tables();
    let (kernel, per_round) = if per_round == 1 {
        (g.chain.clone(), None)
    } else {
        (g.dispatch.clone(), Some(per_round as u32))
    };
    let mut graph = Graph::capture(stream, move |s| {
        launch_dispatcher(s, &kernel, tables, per_round)
    })?;
    graph.prepare_device_launch()?;
    Ok(Sealed { graph })
}

/// The dispatcher's rule (as `dl_dispatch` in `kernels/device_launch.cu`): in queue order,
/// each request goes to the first target whose bound holds it; a round ends after
/// `per_round` requests or before a target it already launched.
fn decide(requests: &[u32], bounds: &[u32], per_round: usize) -> Vec<Decision> {
    let mut out = Vec::with_capacity(requests.len());
    let (mut round, mut taken, mut launched) = (0u32, 0usize, 0u64);
    for &r in requests {
        let target = bounds
            .iter()
            .position(|&b| r <= b)
            .unwrap_or(bounds.len().saturating_sub(1));
        if taken == per_round || launched & (1 << target) != 0 {
            round += 1;
            taken = 0;
            launched = 0;
        }
        launched |= 1 << target;
        taken += 1;
        out.push(Decision { target, round });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::decide;

    #[test]
    fn rounds_end_at_a_repeated_target_or_the_round_size() {
        let d = decide(&[1, 5, 9, 2, 3], &[2, 8, 16], 8);
        let t: Vec<_> = d.iter().map(|d| (d.target, d.round)).collect();
        assert_eq!(t, [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]);
        let d = decide(&[1, 5, 9], &[2, 8, 16], 2);
        let t: Vec<_> = d.iter().map(|d| (d.target, d.round)).collect();
        assert_eq!(t, [(0, 0), (1, 0), (2, 1)]);
        assert!(decide(&[], &[4], 1).is_empty());
    }
}
