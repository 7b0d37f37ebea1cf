//! The MoE weights loader (`WeightsFile::load`) on arbitrary bytes: it returns weights or an
//! error, and never panics or aborts (the bounded proptest twin is `tests/weights.rs`).
//!
//! The first byte picks what the rest is: bit 0 clear, one safetensors file; set, a sharded
//! checkpoint whose `model.safetensors.index.json` is the rest up to the first 0 byte and
//! whose shard `s.safetensors` is what follows. Bit 1 loads strictly, bit 2 by layer index 0.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use warpdrive::moe::{MoeConfig, Router, WeightsFile};
use warpdrive::DTypeKind;

/// A folder of this process's own (`-jobs` / `-workers` run several processes).
fn dir() -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("warpdrive-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok().map(|()| dir)
    })
    .as_ref()
}

fuzz_target!(|data: &[u8]| {
    let (Some(dir), Some((&kind, rest))) = (dir(), data.split_first()) else {
        return;
    };
    let path = if kind & 1 == 0 {
        let file = dir.join("model.safetensors");
        if std::fs::write(&file, rest).is_err() {
            return;
        }
        file
    } else {
        let split = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        let index = dir.join("model.safetensors.index.json");
        let shard = rest.get(split + 1..).unwrap_or_default();
        if std::fs::write(&index, &rest[..split]).is_err()
            || std::fs::write(dir.join("s.safetensors"), shard).is_err()
        {
            return;
        }
        index
    };
    let config = MoeConfig {
        hidden: 4,
        intermediate: 2,
        experts: 2,
        top_k: 1,
        dtype: DTypeKind::F32,
        router: Router::Softmax,
        renormalize: true,
    };
    let mut file = WeightsFile::new(path).strict(kind & 2 != 0);
    if kind & 4 != 0 {
        file = file.layer(0);
    }
    let _ = file.load(&config);
});
