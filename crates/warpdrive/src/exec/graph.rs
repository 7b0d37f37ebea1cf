//! CUDA graphs: a stream segment captured once and replayed with one launch.
//!
//! [`Graph::capture`] runs a closure on a stream in capture mode and keeps the closure with
//! the graph (it owns or borrows what the graph works on, so that outlives the graph). On
//! CUDA the closure runs once, during the capture, and [`Graph::launch`] replays what it
//! enqueued; on the CPU backend the graph is the recorded closure and a launch runs it.
//!
//! Capture rules (DESIGN.md), enforced rather than assumed:
//! - The device's default pool is in capture mode for the stream: allocations come only
//!   from blocks it already holds (run the work once before capturing so they exist), and
//!   the blocks the capture used stay reserved for the graph while it lives.
//! - The capture runs in `THREAD_LOCAL` mode; while it runs, this thread's driver
//!   allocations, event queries, synchronisations and copies from pageable memory are
//!   refused with `Error::Capture` before they reach the driver. An error inside the
//!   closure ends the capture and is returned; the stream is usable afterwards.
//! - warpdrive records no events on the captured stream (the backend's per-buffer event tracking is off).
//!
//! Replaying "with new contents in the same buffers" is the point of a graph, and Rust's
//! borrows would forbid writing a buffer the closure holds. So the buffers can instead be
//! handed to each launch as the graph's *state* ([`Graph::capture_with`] /
//! [`Graph::launch_with`]): on CUDA a launch checks that the state holds the very buffers
//! the graph was captured with (by address), on the CPU backend the closure runs on it.

use crate::device::{Device, GraphExec, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::{device_pool, Buffer, GraphMemory};

/// What a graph works on, handed to each launch. Its buffers' addresses identify it: a CUDA
/// graph replays on the addresses it captured, so a launch with other buffers is refused.
pub trait GraphState {
    /// Appends the device address of every buffer in `self`, in a fixed order.
    fn addresses(&self, out: &mut Vec<u64>);
}

impl GraphState for () {
    fn addresses(&self, _: &mut Vec<u64>) {}
}

impl<T: DType> GraphState for Buffer<T> {
    fn addresses(&self, out: &mut Vec<u64>) {
        out.push(self.device_ptr());
        out.push(self.len() as u64);
    }
}

impl<S: GraphState> GraphState for Vec<S> {
    fn addresses(&self, out: &mut Vec<u64>) {
        self.iter().for_each(|s| s.addresses(out));
    }
}

impl<S: GraphState, const N: usize> GraphState for [S; N] {
    fn addresses(&self, out: &mut Vec<u64>) {
        self.iter().for_each(|s| s.addresses(out));
    }
}

macro_rules! tuple_state {
    ($($name:ident)+) => {
        impl<$($name: GraphState),+> GraphState for ($($name,)+) {
            #[allow(non_snake_case)]
            fn addresses(&self, out: &mut Vec<u64>) {
                let ($($name,)+) = self;
                $($name.addresses(out);)+
            }
        }
    };
}
tuple_state!(A);
tuple_state!(A B);
tuple_state!(A B C);
tuple_state!(A B C D);
tuple_state!(A B C D E);
tuple_state!(A B C D E F);

/// True while this thread is capturing a graph (captures run in `THREAD_LOCAL` mode, so
/// work this thread enqueues goes into the graph, not to the GPU).
pub fn capturing() -> bool {
    crate::device::cuda::thread_is_capturing()
}

type Body<'a, S> = Box<dyn FnMut(&Stream, &mut S) -> Result<()> + 'a>;

/// A captured stream segment that can be replayed. `S` is the state handed to each launch
/// (`()` when the closure owns or borrows everything it uses).
pub struct Graph<'a, S: GraphState = ()> {
    stream: Stream,
    body: Body<'a, S>,
    exec: Exec,
}

enum Exec {
    /// A stream that runs work at once (the CPU backend): launches run the body.
    Recorded,
    Captured {
        /// `None` when the capture enqueued nothing.
        graph: Option<GraphExec>,
        /// The state's addresses at capture.
        addresses: Vec<u64>,
        /// Reused for the check at each launch.
        scratch: Vec<u64>,
        /// Dropped after `graph` (declaration order): the pool blocks it uses.
        _memory: GraphMemory,
    },
}

impl<S: GraphState> std::fmt::Debug for Graph<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graph({:?})", self.stream)
    }
}

impl<'a> Graph<'a, ()> {
    /// Captures what `body` enqueues on `stream` (on the CPU backend: records `body`).
    pub fn capture(
        stream: &Stream,
        mut body: impl FnMut(&Stream) -> Result<()> + 'a,
    ) -> Result<Self> {
        Graph::capture_with(stream, &mut (), move |s, _| body(s))
    }

    /// Replays the graph on its stream.
    pub fn launch(&mut self) -> Result<()> {
        self.launch_with(&mut ())
    }
}

/// Ends a capture when dropped (also when the closure panics), so the stream and this
/// thread leave capture mode whatever happens.
struct Capturing<'s> {
    stream: &'s Stream,
    memory: &'s GraphMemory,
    done: bool,
}

impl Capturing<'_> {
    fn end(&mut self) -> Result<Option<GraphExec>> {
        self.done = true;
        self.memory.end_capture();
        self.stream
            .run((), |()| Ok(None), |(), q| q.gpu.end_capture(q.stream))
    }
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.end() {
                tracing::warn!("ending an abandoned graph capture failed: {e}");
            }
        }
    }
}

impl<'a, S: GraphState> Graph<'a, S> {
    /// Captures what `body` enqueues on `stream` when run on `state`; each launch then takes
    /// the same state ([`Graph::launch_with`]), whose buffers may be rewritten in between.
    pub fn capture_with(
        stream: &Stream,
        state: &mut S,
        body: impl FnMut(&Stream, &mut S) -> Result<()> + 'a,
    ) -> Result<Self> {
        let mut body: Body<'a, S> = Box::new(body);
        let exec = stream.run(
            (&mut body, state),
            |_| Ok(Exec::Recorded),
            |(body, state), q| {
                let mut addresses = Vec::new();
                state.addresses(&mut addresses);
                // Creating the cuBLAS handle allocates: do it before the capture.
                q.gpu.prepare_blas(q.stream)?;
                let memory = device_pool(stream.device())?.begin_capture(stream)?;
                if let Err(e) = q.gpu.begin_capture(q.stream) {
                    memory.end_capture();
                    return Err(e);
                }
                let mut capturing = Capturing {
                    stream,
                    memory: &memory,
                    done: false,
                };
                let ran = body(stream, state);
                let ended = capturing.end();
                drop(capturing);
                // The closure's error first: a broken capture is its consequence.
                ran?;
                Ok(Exec::Captured {
                    graph: ended?,
                    scratch: Vec::with_capacity(addresses.len()),
                    addresses,
                    _memory: memory,
                })
            },
        )?;
        Ok(Graph {
            stream: stream.clone(),
            body,
            exec,
        })
    }

    /// The stream the graph was captured on and replays on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    pub fn device(&self) -> &Device {
        self.stream.device()
    }

    /// Prepares the graph on the device (the driver's graph upload), so its first launch does
    /// no setup work (a no-op on the CPU backend).
    pub fn prepare(&self) -> Result<()> {
        match &self.exec {
            Exec::Captured {
                graph: Some(graph), ..
            } => {
                let q = self.stream.gpu("a graph upload")?;
                q.gpu.upload_graph(graph, q.stream)
            }
            _ => Ok(()),
        }
    }

    /// Makes the graph launchable from the device (a second executable, uploaded) and returns
    /// the handle a kernel passes to `cudaGraphLaunch`; host launches use that executable
    /// from then on. Refused on the CPU backend, for a graph that captured nothing, and for a
    /// graph holding work the device cannot launch (the error names it).
    pub fn prepare_device_launch(&mut self) -> Result<u64> {
        match &mut self.exec {
            Exec::Recorded => Err(Error::Unsupported(
                "launching a graph from the device on the CPU backend".into(),
            )),
            Exec::Captured { graph: None, .. } => Err(Error::InvalidArgument(
                "a graph that captured no work cannot be launched from the device".into(),
            )),
            Exec::Captured {
                graph: Some(graph), ..
            } => {
                let q = self.stream.gpu("a device graph launch")?;
                q.gpu.prepare_device_launch(graph, q.stream)
            }
        }
    }

    /// Replays the graph on its stream with `state`, which must hold the buffers the graph
    /// was captured with (their contents may have changed).
    pub fn launch_with(&mut self, state: &mut S) -> Result<()> {
        match &mut self.exec {
            Exec::Recorded => (self.body)(&self.stream, state),
            Exec::Captured {
                graph,
                addresses,
                scratch,
                ..
            } => {
                if !addresses.is_empty() {
                    scratch.clear();
                    state.addresses(scratch);
                    if scratch != addresses {
                        return Err(Error::InvalidArgument(
                            "a graph replays on the buffers it was captured with; this state \
                             holds others"
                                .into(),
                        ));
                    }
                }
                match graph {
                    Some(g) => {
                        let q = self.stream.gpu("a graph launch")?;
                        q.gpu.launch_graph(g, q.stream)
                    }
                    None => Ok(()),
                }
            }
        }
    }
}
