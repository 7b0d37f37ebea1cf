//! The `weights-load` row of the `moe` suite: one mixtral-8x7b layer (bf16, Hugging Face's
//! per-expert names) from a safetensors file in the page cache to a ready layer.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use half::bf16;
use rand::{Rng, SeedableRng};

use warpdrive::error::{Error, Result};
use warpdrive::memory::Buffer;
use warpdrive::moe::{MoeConfig, MoeLayer, MoeWeights, WeightsFile};
use warpdrive::transfer;

use super::super::results::Ceiling;
use super::super::Ctx;

const CASE: &str = "weights-load";
/// Bytes written and read at a time.
const BLOCK: usize = 64 << 20;

/// Times, over the same file: `warpdrive` (`MoeWeights::File`: mapped, uploaded in bf16
/// through the staging ring), `warpdrive-host-f32` (the host reader's f32 copy, then
/// `MoeWeights::Host`: the path before; one rep) and `upload` (`transfer::upload` of the
/// file's bytes from host memory: the fast path's rate in this run). `extra`: `bytes` (the
/// file's) and on `warpdrive` `pct_of_upload` = upload time / load time · 100. A file that
/// cannot be written (no room in the temp dir) skips the row with a warning.
pub(super) fn weights_load(ctx: &mut Ctx, config: MoeConfig, reps: usize) -> Result<()> {
    ctx.step(format!("{}: {CASE} (writing the checkpoint)", super::SUITE));
    let dir = std::env::temp_dir().join(format!("warpdrive-bench-weights-{}", std::process::id()));
    let path = dir.join("mixtral-layer.safetensors");
    let written = std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(&dir, e))
        .and_then(|()| write_layer(&path, &config));
    let result = match written {
        Ok(bytes) => time_rows(ctx, config, &path, bytes, reps),
        Err(e) => {
            ctx.warn(&format!("{}: {CASE} skipped: {e}", super::SUITE));
            Ok(())
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn time_rows(
    ctx: &mut Ctx,
    config: MoeConfig,
    path: &Path,
    bytes: usize,
    reps: usize,
) -> Result<()> {
    let stream = ctx.stream().clone();
    // Read once: the file is in the page cache for every timing, and `host` is what the
    // upload row sends.
    let host = read_all(path)?;
    let file = WeightsFile::new(path);
    ctx.step(format!("{}: {CASE} (mapped)", super::SUITE));
    let mut load = super::super::timing::time_host(1, reps, || {
        MoeLayer::<bf16>::new(&stream, config, MoeWeights::File(file.clone())).map(drop)
    })?;
    ctx.step(format!("{}: {CASE} (host f32)", super::SUITE));
    let mut old = super::super::timing::time_host(0, 1, || {
        let w = file.load(&config)?;
        MoeLayer::<bf16>::new(&stream, config, MoeWeights::Host(w)).map(drop)
    })?;
    ctx.step(format!("{}: {CASE} (upload)", super::SUITE));
    let mut dev = Buffer::<u8>::uninit(&stream, host.len())?;
    let mut up =
        super::super::timing::time_host(1, reps, || transfer::upload(&stream, &mut dev, &host))?;
    drop(dev);
    let size = bytes as u64;
    let ceiling = Some(Ceiling::H2dPageable);
    let up_median = ctx
        .record_bytes(CASE, size, "upload", &mut up, bytes as f64, ceiling)?
        .median;
    let row = ctx.record_bytes(CASE, size, "warpdrive", &mut load, bytes as f64, ceiling)?;
    let pct = 100.0 * up_median / row.median;
    row.extra.insert("bytes".into(), bytes.into());
    row.extra.insert("pct_of_upload".into(), pct.into());
    row.extra.insert("dtype".into(), "bf16".into());
    let row = ctx.record_bytes(
        CASE,
        size,
        "warpdrive-host-f32",
        &mut old,
        bytes as f64,
        ceiling,
    )?;
    row.extra.insert("bytes".into(), bytes.into());
    Ok(())
}

/// The whole file in a fresh `Vec`.
fn read_all(path: &Path) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut out))
        .map_err(|e| Error::io(path, e))?;
    Ok(out)
}

/// Writes a random bf16 layer of `c` in Hugging Face's per-expert names (values of one
/// binade, so none is NaN or infinite) and returns the file's size.
fn write_layer(path: &PathBuf, c: &MoeConfig) -> Result<usize> {
    let (h, i, e) = (c.hidden, c.intermediate, c.experts);
    let mut tensors = vec![("gate.weight".to_string(), vec![e, h])];
    for x in 0..e {
        let p = format!("model.layers.0.block_sparse_moe.experts.{x}");
        tensors.push((format!("{p}.w1.weight"), vec![i, h]));
        tensors.push((format!("{p}.w3.weight"), vec![i, h]));
        tensors.push((format!("{p}.w2.weight"), vec![h, i]));
    }
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    let mut order = Vec::new();
    for (name, shape) in tensors {
        let len = warpdrive::size::product(&name, &shape)? * 2;
        let name = if name == "gate.weight" {
            "model.layers.0.block_sparse_moe.gate.weight".to_string()
        } else {
            name
        };
        let info =
            serde_json::json!({ "dtype": "BF16", "shape": shape, "data_offsets": [at, at + len] });
        header.insert(name, info);
        order.push(len);
        at += len;
    }
    let mut json = serde_json::to_vec(&header)
        .map_err(|e| Error::InvalidArgument(format!("weights-load header: {e}")))?;
    // Data aligned to 8 bytes, as the format's writers pad it.
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let io = |e| Error::io(path, e);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    f.write_all(&(json.len() as u64).to_le_bytes())
        .map_err(io)?;
    f.write_all(&json).map_err(io)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7765_6967);
    let mut block = vec![0u8; BLOCK];
    let mut left = at;
    while left > 0 {
        let n = left.min(BLOCK);
        for pair in block[..n].chunks_exact_mut(2) {
            // Sign and mantissa random, the exponent of [1/128, 1/64).
            let bits = (rng.random::<u16>() & 0x807f) | 0x3c00;
            pair.copy_from_slice(&bf16::from_bits(bits).to_le_bytes());
        }
        f.write_all(&block[..n]).map_err(io)?;
        left -= n;
    }
    f.flush().map_err(io)?;
    Ok(8 + json.len() + at)
}
