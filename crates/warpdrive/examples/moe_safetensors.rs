//! An MoE layer from a safetensors checkpoint: writes a tiny one (the stacked
//! `gate.weight`, `experts.w1/w3/w2` layout, bf16) to a temp folder, loads it into a layer
//! and runs a forward pass.
//!
//! `cargo run -p warpdrive --example moe_safetensors`

use std::error::Error;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use warpdrive::moe::{MoeConfig, MoeLayer, MoeWeights, WeightsFile};
use warpdrive::{bf16, Buffer, Device};

/// A small deterministic pseudo-random tensor, scaled by 1/√fan_in, as little-endian bf16.
fn tensor_bytes(len: usize, fan_in: usize, seed: u64) -> Vec<u8> {
    let scale = 1.0 / (fan_in as f32).sqrt();
    (0..len as u64)
        .flat_map(|i| {
            let h = (i ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            let v = (h as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale;
            bf16::from_f32(v).to_le_bytes()
        })
        .collect()
}

fn main() -> Result<(), Box<dyn Error>> {
    // hidden 256, intermediate 512, 8 experts, top-2, bf16: runs in milliseconds on a CPU.
    let config = MoeConfig::tiny();
    let (h, i, e) = (config.hidden, config.intermediate, config.experts);

    // 1. A checkpoint with one MoE block (real ones hold many: pick with `.layer(n)`).
    let dir = std::env::temp_dir().join(format!("warpdrive-example-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("model.safetensors");
    let tensors = [
        ("gate.weight", vec![e, h], tensor_bytes(e * h, h, 1)),
        ("experts.w1", vec![e, i, h], tensor_bytes(e * i * h, h, 2)),
        ("experts.w3", vec![e, i, h], tensor_bytes(e * i * h, h, 3)),
        ("experts.w2", vec![e, h, i], tensor_bytes(e * h * i, i, 4)),
    ];
    let mut views = Vec::new();
    for (name, shape, bytes) in &tensors {
        views.push((*name, TensorView::new(Dtype::BF16, shape.clone(), bytes)?));
    }
    std::fs::write(&path, safetensors::serialize(views, None)?)?;

    // 2. The layer: the file is memory-mapped and its bf16 tensors go to the device as they are.
    let device = Device::best()?;
    let stream = device.new_stream()?;
    let mut layer =
        MoeLayer::<bf16>::new(&stream, config, MoeWeights::File(WeightsFile::new(&path)))?;

    // 3. A forward pass over 32 tokens.
    let tokens = 32;
    let x: Vec<bf16> = (0..tokens * h)
        .map(|k| bf16::from_f32(((k % 17) as f32 - 8.0) / 8.0))
        .collect();
    let x = Buffer::from_host(&stream, &x)?;
    let mut y = Buffer::<bf16>::zeros(&stream, tokens * h)?;
    layer.forward_into(&x, &mut y)?;
    let y = y.to_host(&stream)?;
    let routing = layer.route(&x)?;
    println!(
        "{}: {tokens} tokens through {e} experts (top-{}), {} experts used; y[0..4] = {:?}",
        device.label(),
        config.top_k,
        routing.distinct_experts(),
        &y[..4]
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
