//! What a job runs.

use half::bf16;
use warpdrive::moe::{MoeConfig, MoeLayer, MoeWeights};
use warpdrive::{Buffer, Device, Error, Result, Stream};

/// A model the service batches jobs for: rows of `width` values in, as many rows out. Made
/// and run on the batcher's thread only (GPU state such as captured graphs stays there).
pub trait Model: 'static {
    /// The name jobs and errors use (`moe:qwen3-30b-a3b`).
    fn name(&self) -> &str;
    /// Values per row, in and out.
    fn width(&self) -> usize;
    /// `output = model(input)` for `input.len() / width` rows.
    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()>;
    /// True once the model's device cannot run anything again (a sticky fault).
    fn is_lost(&self) -> bool {
        false
    }
    /// Bytes of device memory the model's pool has in use and holds (for the status and
    /// the dashboard; zeros when it has none).
    fn pool_bytes(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Bytes of device memory a job of `rows` rows takes while its batch runs (its share of
    /// the batch's buffers): what its tenant's device budget is charged. Zero for a model
    /// without device memory.
    fn device_bytes(&self, rows: usize) -> usize {
        let _ = rows;
        0
    }
}

/// The MoE layer (bf16) as a [`Model`]: rows are tokens of `hidden` values.
pub struct MoeModel {
    name: String,
    device: Device,
    stream: Stream,
    layer: MoeLayer<bf16>,
    hidden: usize,
    intermediate: usize,
    top_k: usize,
    /// The batch's rows in and out as bf16 on the host, kept from batch to batch.
    staging: Vec<bf16>,
    out: Vec<bf16>,
}

impl MoeModel {
    /// The layer `config` with `weights` on `device`, named `name`.
    pub fn new(
        name: &str,
        device: &Device,
        config: MoeConfig,
        weights: MoeWeights,
    ) -> Result<MoeModel> {
        let stream = device.new_stream()?;
        let (hidden, intermediate, top_k) = (config.hidden, config.intermediate, config.top_k);
        let layer = MoeLayer::new(&stream, config, weights)?;
        Ok(MoeModel {
            name: name.to_string(),
            device: device.clone(),
            stream,
            layer,
            hidden,
            intermediate,
            top_k,
            staging: Vec::new(),
            out: Vec::new(),
        })
    }
}

impl Model for MoeModel {
    fn name(&self) -> &str {
        &self.name
    }

    fn width(&self) -> usize {
        self.hidden
    }

    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()> {
        if input.len() % self.hidden != 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: {} values are not whole rows of {}",
                self.name,
                input.len(),
                self.hidden
            )));
        }
        self.staging.clear();
        self.staging
            .extend(input.iter().map(|&v| bf16::from_f32(v)));
        let x = Buffer::from_host(&self.stream, &self.staging)?;
        let y = self.layer.forward(&x)?;
        self.out.resize(y.len(), bf16::ZERO);
        y.copy_to_host(&self.stream, &mut self.out)?;
        output.clear();
        output.extend(self.out.iter().map(|v| v.to_f32()));
        Ok(())
    }

    fn is_lost(&self) -> bool {
        self.device.is_lost()
    }

    fn device_bytes(&self, rows: usize) -> usize {
        // Per token: x and y, k routed copies of the row, k gate/up activations (two of
        // `intermediate`) and k expert outputs, in bf16, plus k routing entries (index and
        // weight); an upper estimate of the buffers a pass allocates for it.
        let (h, i, k) = (self.hidden, self.intermediate, self.top_k);
        let per_row = 2 * h + k * (h + 2 * i + h);
        per_row
            .saturating_mul(std::mem::size_of::<bf16>())
            .saturating_add(k * 8)
            .saturating_mul(rows)
    }

    fn pool_bytes(&self) -> (u64, u64) {
        warpdrive::memory::device_pool(&self.device)
            .and_then(|p| p.stats())
            .map_or((0, 0), |s| (s.in_use, s.reserved))
    }
}

/// A job kind that answers each row with itself: the stand-in that measures the request
/// path (bodies, parsing, batching, scatter, replies) with no model in the way, at the real
/// model's width.
pub struct Echo {
    width: usize,
}

impl Echo {
    /// Rows of `width` values.
    pub fn new(width: usize) -> Echo {
        Echo { width }
    }
}

impl Model for Echo {
    fn name(&self) -> &str {
        "echo"
    }

    fn width(&self) -> usize {
        self.width
    }

    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()> {
        output.clear();
        output.extend_from_slice(input);
        Ok(())
    }
}
