//! CUDA graphs: capture, upload and launch.

use cudarc::driver::sys;
use cudarc::driver::{result, CudaGraph};

use crate::error::{Error, Result};

use super::super::activity::{self, ActivityKind};
use super::context::{lost_error, CudaDevice, BOUND, CAPTURING};
use super::stream::GpuStream;

/// An instantiated CUDA graph, as the floors above hold it.
pub(crate) struct GraphExec(CudaGraph);

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
        Ok(self.check("cuStreamEndCapture", r)?.map(GraphExec))
    }

    /// Uploads `graph` to the device on `stream`, so its first launch does no setup.
    pub(crate) fn upload_graph(&self, graph: &GraphExec, stream: &GpuStream) -> Result<()> {
        self.lean("cuGraphUpload", || {
            // SAFETY: the executable graph is alive (borrowed) and belongs to this context.
            unsafe { result::graph::upload(graph.0.cu_graph_exec(), stream.cu_stream()) }
        })
    }

    /// Launches `graph` on `stream` (the lean path, as kernel launches).
    pub(crate) fn launch_graph(&self, graph: &GraphExec, stream: &GpuStream) -> Result<()> {
        let t = activity::begin();
        self.lean("cuGraphLaunch", || {
            // SAFETY: the executable graph is alive (borrowed) and belongs to this context.
            unsafe { result::graph::launch(graph.0.cu_graph_exec(), stream.cu_stream()) }
        })?;
        activity::end(t, ActivityKind::GraphLaunch, stream.cu_stream() as u64, 0);
        Ok(())
    }
}
