//! CUDA graphs: capture, upload and launch.

use cudarc::driver::sys;
use cudarc::driver::{result, CudaGraph};

use crate::error::{Error, Result};

use super::super::activity::{self, ActivityKind};
use super::context::{lost_error, CudaDevice, BOUND, CAPTURING};
use super::stream::GpuStream;

/// An instantiated CUDA graph, as the floors above hold it.
pub(crate) struct GraphExec {
    /// A second executable of the same graph, instantiated for launches from the device
    /// ([`CudaDevice::prepare_device_launch`]); dropped first.
    device: Option<DeviceExec>,
    graph: CudaGraph,
}

impl GraphExec {
    /// The executable graph kernels launch from the device (`cudaGraphExec_t`), once
    /// [`CudaDevice::prepare_device_launch`] made it.
    pub(crate) fn device_handle(&self) -> Option<u64> {
        self.device.as_ref().map(|d| d.0 as u64)
    }

    /// The executable host launches use: the device-launch one once it exists (a graph that
    /// relaunches itself from the device must have been started as that executable).
    fn launched(&self) -> sys::CUgraphExec {
        match &self.device {
            Some(d) => d.0,
            None => self.graph.cu_graph_exec(),
        }
    }
}

/// An executable graph instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH`.
struct DeviceExec(sys::CUgraphExec);

// SAFETY: an executable graph is a driver handle with no thread affinity; warpdrive calls on
// one are serialised by the `&mut` / `&` borrows of the owning `GraphExec`.
unsafe impl Send for DeviceExec {}
// SAFETY: as above (shared access only reads the handle's value).
unsafe impl Sync for DeviceExec {}

impl Drop for DeviceExec {
    fn drop(&mut self) {
        // SAFETY: instantiated by prepare_device_launch and destroyed only here.
        if let Err(e) = unsafe { result::graph::exec_destroy(self.0) } {
            tracing::warn!("destroying a device-launch graph failed: {e:?}");
        }
    }
}

/// The node types a graph launched from the device may hold (CUDA Programming Guide, device
/// graph launch).
fn device_launchable(t: sys::CUgraphNodeType) -> bool {
    use sys::CUgraphNodeType as T;
    matches!(
        t,
        T::CU_GRAPH_NODE_TYPE_KERNEL
            | T::CU_GRAPH_NODE_TYPE_MEMCPY
            | T::CU_GRAPH_NODE_TYPE_MEMSET
            | T::CU_GRAPH_NODE_TYPE_GRAPH
            | T::CU_GRAPH_NODE_TYPE_EMPTY
    )
}

impl CudaDevice {
    // ---- graphs ----

    /// Starts capturing `stream` (THREAD_LOCAL mode). Every successful call must be paired
    /// with [`end_capture`](Self::end_capture) on the same thread.
    pub(crate) fn begin_capture(&self, stream: &GpuStream) -> Result<()> {
        if self.is_capturing(stream)? {
            return Err(Error::Capture {
                call: "cuStreamBeginCapture",
                hint: "the stream is already capturing a graph".into(),
            });
        }
        let r = stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        self.check("cuStreamBeginCapture", r)?;
        CAPTURING.with(|c| c.set(c.get() + 1));
        Ok(())
    }

    /// Ends the capture begun by [`begin_capture`](Self::begin_capture) and instantiates the
    /// graph (`None` when nothing was captured). The stream leaves capture mode even when
    /// this fails (for instance when the capture was invalidated).
    pub(crate) fn end_capture(&self, stream: &GpuStream) -> Result<Option<GraphExec>> {
        CAPTURING.with(|c| c.set(c.get().saturating_sub(1)));
        if self.is_lost() {
            return Err(lost_error());
        }
        let r = stream
            .shared()
            .end_capture(sys::CUgraphInstantiate_flags(0));
        BOUND.with(|b| b.set(self.ctx_key()));
        Ok(self.check("cuStreamEndCapture", r)?.map(|graph| GraphExec {
            device: None,
            graph,
        }))
    }

    /// Uploads `graph` to the device on `stream`, so its first launch does no setup.
    pub(crate) fn upload_graph(&self, graph: &GraphExec, stream: &GpuStream) -> Result<()> {
        self.lean("cuGraphUpload", || {
            // SAFETY: the executable graph is alive (borrowed) and belongs to this context.
            unsafe { result::graph::upload(graph.launched(), stream.cu_stream()) }
        })
    }

    /// Launches `graph` on `stream` (the lean path, as kernel launches).
    pub(crate) fn launch_graph(&self, graph: &GraphExec, stream: &GpuStream) -> Result<()> {
        let t = activity::begin();
        self.lean("cuGraphLaunch", || {
            // SAFETY: the executable graph is alive (borrowed) and belongs to this context.
            unsafe { result::graph::launch(graph.launched(), stream.cu_stream()) }
        })?;
        activity::end(t, ActivityKind::GraphLaunch, stream.cu_stream() as u64, 0);
        Ok(())
    }

    /// Instantiates `graph` a second time for launches from the device and uploads that
    /// executable on `stream`; returns its handle for kernel parameters. A graph holding a
    /// node the device cannot launch is refused with the node's type, one the driver refuses
    /// with its error and the rules.
    pub(crate) fn prepare_device_launch(
        &self,
        graph: &mut GraphExec,
        stream: &GpuStream,
    ) -> Result<u64> {
        if let Some(h) = graph.device_handle() {
            return Ok(h);
        }
        self.bind()?;
        let g = graph.graph.cu_graph();
        let mut count = 0usize;
        // SAFETY: the graph is alive (owned by `graph`); a null node array asks for the count.
        let r = unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut count) };
        self.check("cuGraphGetNodes", r.result())?;
        if count == 0 {
            return Err(Error::InvalidArgument(
                "a graph that captured no work cannot be launched from the device".into(),
            ));
        }
        let mut nodes = vec![std::ptr::null_mut(); count];
        // SAFETY: as above; `nodes` holds `count` entries.
        let r = unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut count) };
        self.check("cuGraphGetNodes", r.result())?;
        for &node in nodes.iter().take(count) {
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` belongs to the live graph; `t` is a valid out-pointer.
            let r = unsafe { sys::cuGraphNodeGetType(node, &mut t) };
            self.check("cuGraphNodeGetType", r.result())?;
            if !device_launchable(t) {
                return Err(Error::Unsupported(format!(
                    "a graph launched from the device may hold only kernel, memcpy, memset and \
                     child-graph nodes; this one holds a {t:?} node"
                )));
            }
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH.0;
        // SAFETY: the graph is alive; `exec` is a valid out-pointer.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, g, flags as u64) };
        match self.check("cuGraphInstantiateWithFlags", r.result()) {
            Ok(()) => {}
            Err(e) if e.is_device_lost() => return Err(e),
            Err(e) => {
                return Err(Error::Unsupported(format!(
                    "the driver refused to instantiate this graph for launch from the device \
                     ({e}): its kernels must all run on one device, with no cooperative launch, \
                     and its copies must be between device or pinned memory"
                )))
            }
        }
        let device = DeviceExec(exec);
        self.lean("cuGraphUpload", || {
            // SAFETY: the executable graph is alive (owned by `device`) and belongs to this
            // context.
            unsafe { result::graph::upload(device.0, stream.cu_stream()) }
        })?;
        let handle = device.0 as u64;
        graph.device = Some(device);
        Ok(handle)
    }
}
