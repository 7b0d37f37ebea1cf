//! Loading MoE weights from safetensors ([`WeightsFile`]): one layer out of a file that holds
//! many (by prefix or layer index; none given with several there is an error listing them), a
//! Hugging Face sharded checkpoint (index file or folder), NaN and infinity (a warning, or an
//! error when strict), and malformed input: truncated files, bad header lengths, generated
//! headers with absurd shapes, offsets and dtypes, bad JSON, broken indexes and absurd configs
//! each give an error, never a panic or an abort (proptest, a bounded number of cases; the
//! cargo-fuzz target in `fuzz/` runs the same loader without a bound). A layer built from a
//! file (mapped, kept in the file's dtype where it is the layer's) holds the same bits as one
//! built from what the host reader gives, for every pair of file and layer dtype, and every
//! malformed case fails it as it fails the host reader.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use common::{device_test, random_f32, rng, seed};
use half::{bf16, f16};
use proptest::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use warpdrive::moe::{HostWeights, MoeConfig, MoeLayer, MoeWeights, Router, WeightsFile};
use warpdrive::{DTypeKind, Device, Error, Float, Stream};

const PREFIX_0: &str = "model.layers.0.mlp.";
const PREFIX_1: &str = "model.layers.1.mlp.";

fn config(h: usize, i: usize, e: usize) -> MoeConfig {
    MoeConfig {
        hidden: h,
        intermediate: i,
        experts: e,
        top_k: 1,
        dtype: DTypeKind::F32,
        router: Router::Softmax,
        renormalize: true,
    }
}

/// The small config the malformed-input tests load with (a layer's sizes: multiples of 8).
fn tiny() -> MoeConfig {
    config(8, 8, 2)
}

/// A fresh folder for one test, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(test: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("wd-weights-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

type Tensor = (String, Vec<usize>, Vec<f32>);

fn serialize(tensors: &[Tensor]) -> Vec<u8> {
    serialize_as(tensors, Dtype::F32)
}

/// The tensors as a safetensors file of `dtype` (f32, f16 or bf16; values rounded to it).
fn serialize_as(tensors: &[Tensor], dtype: Dtype) -> Vec<u8> {
    let encode = |x: f32| -> Vec<u8> {
        match dtype {
            Dtype::F16 => f16::from_f32(x).to_le_bytes().to_vec(),
            Dtype::BF16 => bf16::from_f32(x).to_le_bytes().to_vec(),
            _ => x.to_le_bytes().to_vec(),
        }
    };
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|&x| encode(x)).collect())
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            let view = TensorView::new(dtype, s.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn write(path: &Path, tensors: &[Tensor]) {
    std::fs::write(path, serialize(tensors)).unwrap();
}

fn random_weights(c: &MoeConfig, seed: u64) -> HostWeights {
    let mut r = rng(seed);
    let (h, i, e) = (c.hidden, c.intermediate, c.experts);
    HostWeights {
        gate: random_f32(&mut r, e * h),
        gate_bias: Some(random_f32(&mut r, e)),
        w1: random_f32(&mut r, e * i * h),
        w3: random_f32(&mut r, e * i * h),
        w2: random_f32(&mut r, e * h * i),
    }
}

/// `w` under `prefix` in Hugging Face's per-expert names (`experts.{e}.gate_proj.weight` ...).
fn per_expert(prefix: &str, c: &MoeConfig, w: &HostWeights) -> Vec<Tensor> {
    let (h, i, e) = (c.hidden, c.intermediate, c.experts);
    let mut t = vec![
        (format!("{prefix}gate.weight"), vec![e, h], w.gate.clone()),
        (
            format!("{prefix}gate.bias"),
            vec![e],
            w.gate_bias.clone().unwrap(),
        ),
    ];
    let n = i * h;
    for x in 0..e {
        let p = format!("{prefix}experts.{x}");
        let rows = |v: &[f32]| v[x * n..(x + 1) * n].to_vec();
        t.push((format!("{p}.gate_proj.weight"), vec![i, h], rows(&w.w1)));
        t.push((format!("{p}.up_proj.weight"), vec![i, h], rows(&w.w3)));
        t.push((format!("{p}.down_proj.weight"), vec![h, i], rows(&w.w2)));
    }
    t
}

/// `w` under `prefix` in stacked names (`experts.w1` [E, I, H] ...), no bias.
fn stacked(prefix: &str, c: &MoeConfig, w: &HostWeights) -> Vec<Tensor> {
    let (h, i, e) = (c.hidden, c.intermediate, c.experts);
    vec![
        (format!("{prefix}gate.weight"), vec![e, h], w.gate.clone()),
        (format!("{prefix}experts.w1"), vec![e, i, h], w.w1.clone()),
        (format!("{prefix}experts.w3"), vec![e, i, h], w.w3.clone()),
        (format!("{prefix}experts.w2"), vec![e, h, i], w.w2.clone()),
    ]
}

/// Tensors a real checkpoint keeps beside the MoE blocks.
fn attention(prefix: &str, h: usize) -> Vec<Tensor> {
    vec![(
        format!("{prefix}self_attn.q_proj.weight"),
        vec![h, h],
        vec![0.5; h * h],
    )]
}

#[test]
fn a_file_with_two_layers_needs_a_prefix_or_a_layer() {
    let s = seed("a_file_with_two_layers_needs_a_prefix_or_a_layer");
    let c = config(8, 4, 3);
    let (w0, w1) = (random_weights(&c, s), random_weights(&c, s ^ 1));
    let dir = TempDir::new("two-layers");
    let path = dir.join("two.safetensors");
    let mut t = per_expert(PREFIX_0, &c, &w0);
    t.extend(per_expert(PREFIX_1, &c, &w1));
    t.extend(attention("model.layers.0.", 8));
    write(&path, &t);

    let err = WeightsFile::new(&path).load(&c).unwrap_err().to_string();
    assert!(
        err.contains(PREFIX_0) && err.contains(PREFIX_1),
        "the error lists the candidates: {err}"
    );
    assert_eq!(WeightsFile::new(&path).layer(1).load(&c).unwrap(), w1);
    assert_eq!(WeightsFile::new(&path).layer(0).load(&c).unwrap(), w0);
    assert_eq!(
        WeightsFile::new(&path)
            .prefix("model.layers.1.mlp")
            .load(&c)
            .unwrap(),
        w1
    );
    let err = WeightsFile::new(&path).layer(2).load(&c).unwrap_err();
    assert!(err.to_string().contains(PREFIX_1), "{err}");
    let err = WeightsFile::new(&path).prefix("mlp.").load(&c).unwrap_err();
    assert!(err.to_string().contains(PREFIX_0), "{err}");
}

#[test]
fn a_single_block_loads_without_a_prefix() {
    let s = seed("a_single_block_loads_without_a_prefix");
    let c = config(8, 4, 3);
    let w = random_weights(&c, s);
    let dir = TempDir::new("single");
    let path = dir.join("model.safetensors");
    let mut t = per_expert(PREFIX_1, &c, &w);
    t.extend(attention("model.layers.1.", 8));
    write(&path, &t);
    assert_eq!(WeightsFile::new(&path).load(&c).unwrap(), w);
    // A folder with only `model.safetensors` is that file.
    assert_eq!(WeightsFile::new(&dir.0).load(&c).unwrap(), w);
    let err = WeightsFile::new(dir.join("nothing-here")).load(&c);
    assert!(matches!(err, Err(Error::Io { .. })), "{err:?}");

    // Mixtral's per-expert names (`w1.weight` ...) and DeepSeek-V3's router bias name.
    let renamed: Vec<Tensor> = per_expert("model.layers.5.block_sparse_moe.", &c, &w)
        .into_iter()
        .map(|(n, s, v)| {
            let n = n
                .replace("gate.bias", "gate.e_score_correction_bias")
                .replace("gate_proj", "w1")
                .replace("up_proj", "w3")
                .replace("down_proj", "w2");
            (n, s, v)
        })
        .collect();
    let path = dir.join("mixtral.safetensors");
    write(&path, &renamed);
    assert_eq!(WeightsFile::new(&path).layer(5).load(&c).unwrap(), w);
}

fn write_index(path: &Path, map: &[(&str, &str)]) {
    let weight_map: serde_json::Map<String, serde_json::Value> = map
        .iter()
        .map(|(n, f)| (n.to_string(), serde_json::Value::from(*f)))
        .collect();
    let index = serde_json::json!({
        "metadata": { "total_size": 0 },
        "weight_map": weight_map,
    });
    std::fs::write(path, serde_json::to_vec_pretty(&index).unwrap()).unwrap();
}

/// Two layers over three shards the way Hugging Face splits them (layer 1's router in one
/// shard, its experts in the next); returns the folder, the index and the two layers.
fn sharded(dir: &TempDir, c: &MoeConfig, s: u64) -> (PathBuf, HostWeights, HostWeights) {
    let (w0, w1) = (random_weights(c, s), random_weights(c, s ^ 1));
    let mut shard1 = per_expert(PREFIX_0, c, &w0);
    shard1.extend(attention("model.layers.0.", c.hidden));
    let mut l1 = stacked(PREFIX_1, c, &w1).into_iter();
    let mut shard2 = attention("model.layers.1.", c.hidden);
    shard2.extend(l1.next());
    let shard3: Vec<Tensor> = l1.collect();
    let mut map = Vec::new();
    let files = [
        "m-1-of-3.safetensors",
        "m-2-of-3.safetensors",
        "m-3-of-3.safetensors",
    ];
    for (file, tensors) in files.iter().zip([&shard1, &shard2, &shard3]) {
        write(&dir.join(file), tensors);
        map.extend(tensors.iter().map(|t| (t.0.clone(), *file)));
    }
    let map: Vec<(&str, &str)> = map.iter().map(|(n, f)| (n.as_str(), *f)).collect();
    let index = dir.join("model.safetensors.index.json");
    write_index(&index, &map);
    let w1 = HostWeights {
        gate_bias: None,
        ..w1
    };
    (index, w0, w1)
}

#[test]
fn a_sharded_checkpoint_loads_by_index_or_folder() {
    let s = seed("a_sharded_checkpoint_loads_by_index_or_folder");
    let c = config(8, 4, 3);
    let dir = TempDir::new("sharded");
    let (index, w0, w1) = sharded(&dir, &c, s);
    assert_eq!(WeightsFile::new(&index).layer(1).load(&c).unwrap(), w1);
    assert_eq!(WeightsFile::new(&dir.0).layer(0).load(&c).unwrap(), w0);
    let err = WeightsFile::new(&dir.0).load(&c).unwrap_err().to_string();
    assert!(
        err.contains(PREFIX_0) && err.contains(PREFIX_1),
        "the error lists the candidates: {err}"
    );
}

#[test]
fn a_broken_index_is_an_error_naming_what_is_wrong() {
    let c = config(8, 4, 3);
    let dir = TempDir::new("broken-index");
    let (index, _, _) = sharded(&dir, &c, 5);
    let load = |layer| WeightsFile::new(&index).layer(layer).load(&c);

    // A shard the index names is gone: only the layers in it fail.
    std::fs::remove_file(dir.join("m-3-of-3.safetensors")).unwrap();
    match load(1) {
        Err(Error::Io { path, .. }) => assert!(path.ends_with("m-3-of-3.safetensors")),
        other => panic!("a missing shard loaded: {other:?}"),
    }
    assert!(load(0).is_ok());

    // The index puts a tensor in a shard that does not hold it.
    let expert = format!("{PREFIX_0}experts.0.gate_proj.weight");
    write_index(
        &index,
        &[
            (&format!("{PREFIX_0}gate.weight"), "m-2-of-3.safetensors"),
            (&expert, "m-1-of-3.safetensors"),
        ],
    );
    let err = load(0).unwrap_err().to_string();
    assert!(
        err.contains("gate.weight") && err.contains("m-2-of-3"),
        "{err}"
    );

    // Shards outside the index's folder are refused, not read.
    for shard in ["../m-1-of-3.safetensors", "/etc/hostname", "", "."] {
        write_index(&index, &[(&format!("{PREFIX_0}gate.weight"), shard)]);
        let err = load(0).unwrap_err().to_string();
        assert!(
            err.contains("not a file name beside the index"),
            "{shard}: {err}"
        );
    }

    std::fs::write(&index, b"{\"weight_map\": [1, 2").unwrap();
    let err = load(0).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    std::fs::write(&index, b"{\"metadata\": {}}").unwrap();
    let err = load(0).unwrap_err().to_string();
    assert!(err.contains("weight_map"), "{err}");
}

/// WARN events logged on this thread while `f` runs, as their messages.
fn warnings<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Level, Metadata};

    struct Warnings(Arc<Mutex<Vec<String>>>);
    struct Message(String);
    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }
    impl tracing::Subscriber for Warnings {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            if *event.metadata().level() == Level::WARN {
                let mut m = Message(String::new());
                event.record(&mut m);
                self.0.lock().unwrap().push(m.0);
            }
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let r = tracing::subscriber::with_default(Warnings(seen.clone()), f);
    let seen = seen.lock().unwrap().clone();
    (r, seen)
}

#[test]
fn non_finite_weights_warn_or_fail_when_strict() {
    let s = seed("non_finite_weights_warn_or_fail_when_strict");
    let c = config(8, 4, 3);
    let mut w = random_weights(&c, s);
    w.gate[3] = f32::INFINITY;
    let n = c.intermediate * c.hidden;
    for v in &mut w.w1[n + 1..n + 6] {
        *v = f32::NAN; // expert 1's gate_proj: 5 NaN
    }
    let dir = TempDir::new("non-finite");
    let path = dir.join("nan.safetensors");
    write(&path, &per_expert(PREFIX_0, &c, &w));

    let (loaded, warned) = warnings(|| WeightsFile::new(&path).load(&c));
    let loaded = loaded.unwrap();
    assert_eq!(loaded.w1.iter().filter(|v| v.is_nan()).count(), 5);
    assert_eq!(warned.len(), 2, "one warning per tensor: {warned:?}");
    let expert = format!("{PREFIX_0}experts.1.gate_proj.weight");
    assert!(
        warned
            .iter()
            .any(|m| m.contains(&expert) && m.contains(" 5 ")),
        "{warned:?}"
    );
    assert!(
        warned
            .iter()
            .any(|m| m.contains(&format!("{PREFIX_0}gate.weight")) && m.contains(" 1 ")),
        "{warned:?}"
    );

    let err = WeightsFile::new(&path)
        .strict(true)
        .load(&c)
        .unwrap_err()
        .to_string();
    assert!(err.contains("gate.weight") && err.contains(" 1 "), "{err}");
    w.gate[3] = 0.0;
    write(&path, &per_expert(PREFIX_0, &c, &w));
    let err = WeightsFile::new(&path)
        .strict(true)
        .load(&c)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&expert) && err.contains(" 5 "), "{err}");

    // Finite weights load under strict loading without a warning.
    let clean = random_weights(&c, s ^ 2);
    write(&path, &per_expert(PREFIX_0, &c, &clean));
    let (loaded, warned) = warnings(|| WeightsFile::new(&path).strict(true).load(&c));
    assert_eq!(loaded.unwrap(), clean);
    assert!(warned.is_empty(), "{warned:?}");
}

#[test]
fn an_absurd_config_is_an_error_not_a_panic() {
    let dir = TempDir::new("absurd-config");
    let path = dir.join("gate.safetensors");
    write(&path, &[("gate.weight".into(), vec![2, 4], vec![0.25; 8])]);
    // E·I·H overflows; before, the loader reserved that many values up front.
    for c in [config(4, usize::MAX / 4, 2), config(4, 1 << 40, 2)] {
        let err = WeightsFile::new(&path).load(&c).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
}

// ---- malformed input: errors, never a panic or an abort ----

/// A valid one-block file for `tiny()`.
fn valid_file() -> Vec<u8> {
    let c = tiny();
    serialize(&stacked("", &c, &random_weights(&c, 7)))
}

/// Loads `bytes` as a safetensors file with `tiny()` (what every malformed case runs), by
/// the host reader and into a layer on the CPU backend: both fail or neither does.
fn load_bytes(dir: &TempDir, bytes: &[u8]) -> warpdrive::Result<HostWeights> {
    let path = dir.join("case.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let read = WeightsFile::new(&path).load(&tiny());
    let stream = Device::cpu().new_stream().unwrap();
    let layer = MoeLayer::<f32>::new(&stream, tiny(), MoeWeights::File(WeightsFile::new(&path)));
    assert_eq!(
        layer.as_ref().err().map(ToString::to_string),
        read.as_ref().err().map(ToString::to_string),
        "the layer's load and the host reader differ"
    );
    read
}

// ---- layers from files: the mapped upload against the host reader ----

/// Every value's bits, tensor by tensor.
fn bits(w: &HostWeights) -> Vec<Vec<u32>> {
    let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
    let mut out = vec![b(&w.gate), b(&w.w1), b(&w.w3), b(&w.w2)];
    out.extend(w.gate_bias.as_deref().map(b));
    out
}

/// A layer of `T` from `file` holds the bits of one built from what the host reader gives.
fn same_as_host_reader<T: Float>(stream: &Stream, mut c: MoeConfig, file: &WeightsFile) {
    c.dtype = T::KIND;
    let mapped = MoeLayer::<T>::new(stream, c, MoeWeights::File(file.clone())).unwrap();
    let read = MoeLayer::<T>::new(stream, c, MoeWeights::Host(file.load(&c).unwrap())).unwrap();
    assert!(
        bits(&mapped.host_weights().unwrap()) == bits(&read.host_weights().unwrap()),
        "{} into a {} layer: other bits than the host reader's",
        file.path().display(),
        T::KIND.name()
    );
}

device_test!(
    layers_from_files_hold_the_host_readers_bits,
    gpu_layers_from_files_hold_the_host_readers_bits,
    |dev| {
        let s = seed("layers_from_files_hold_the_host_readers_bits");
        let stream = dev.new_stream().unwrap();
        let dir = TempDir::new(&format!("dtypes-{}", dev.label()));
        // Both backends take multiples of 8 only (`MoeConfig::validate`).
        for (h, i, e) in [(16, 8, 3), (24, 16, 2)] {
            let c = config(h, i, e);
            let w = random_weights(&c, s);
            for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
                let names = [
                    ("stacked", stacked("", &c, &w)),
                    ("per-expert", per_expert(PREFIX_0, &c, &w)),
                ];
                for (name, tensors) in names {
                    let path = dir.join(&format!("{name}-{h}-{dtype:?}.safetensors"));
                    std::fs::write(&path, serialize_as(&tensors, dtype)).unwrap();
                    let file = WeightsFile::new(&path);
                    same_as_host_reader::<bf16>(&stream, c, &file);
                    same_as_host_reader::<f16>(&stream, c, &file);
                    if !dev.is_cuda() {
                        same_as_host_reader::<f32>(&stream, c, &file);
                    }
                }
            }
        }
        let c = config(16, 8, 3);
        let (index, _, _) = sharded(&dir, &c, s);
        for layer in [0, 1] {
            same_as_host_reader::<bf16>(&stream, c, &WeightsFile::new(&index).layer(layer));
        }
        same_as_host_reader::<f16>(&stream, c, &WeightsFile::new(&dir.0).layer(1));
    }
);

#[test]
fn a_layer_from_a_file_warns_of_non_finite_values_or_fails_when_strict() {
    let s = seed("a_layer_from_a_file_warns_of_non_finite_values_or_fails_when_strict");
    let c = MoeConfig {
        dtype: DTypeKind::BF16,
        ..config(8, 8, 3)
    };
    let mut w = random_weights(&c, s);
    let n = c.intermediate * c.hidden;
    for v in &mut w.w2[2 * n..2 * n + 3] {
        *v = f32::INFINITY; // expert 2's down_proj: 3 infinities
    }
    let dir = TempDir::new("layer-non-finite");
    let path = dir.join("inf.safetensors");
    std::fs::write(
        &path,
        serialize_as(&per_expert(PREFIX_0, &c, &w), Dtype::BF16),
    )
    .unwrap();
    let stream = Device::cpu().new_stream().unwrap();
    let layer = |strict: bool| {
        let file = WeightsFile::new(&path).strict(strict);
        MoeLayer::<bf16>::new(&stream, c, MoeWeights::File(file))
    };
    let (lenient, warned) = warnings(|| layer(false));
    let held = lenient.unwrap().host_weights().unwrap();
    assert_eq!(held.w2.iter().filter(|v| v.is_infinite()).count(), 3);
    let expert = format!("{PREFIX_0}experts.2.down_proj.weight");
    assert!(
        warned.len() == 1 && warned[0].contains(&expert) && warned[0].contains(" 3 "),
        "{warned:?}"
    );
    let err = layer(true).unwrap_err().to_string();
    assert!(err.contains(&expert) && err.contains(" 3 "), "{err}");
    // A stacked tensor is counted once, over all its experts.
    let mut stacked_w = stacked("", &c, &w);
    stacked_w[3].2[0] = f32::NAN;
    std::fs::write(&path, serialize_as(&stacked_w, Dtype::F16)).unwrap();
    let err = layer(true).unwrap_err().to_string();
    assert!(err.contains("`experts.w2`") && err.contains(" 4 "), "{err}");
}

#[test]
fn a_file_shorter_than_its_header_says_fails_the_layer_not_the_process() {
    let dir = TempDir::new("short");
    let full = valid_file();
    // The header's last tensor ends past the end of the file.
    let err = load_bytes(&dir, &full[..full.len() - 2])
        .unwrap_err()
        .to_string();
    assert!(err.contains("span"), "{err}");
    // A header longer than the file.
    let mut bytes = full.clone();
    bytes[..8].copy_from_slice(&(full.len() as u64).to_le_bytes());
    let err = load_bytes(&dir, &bytes).unwrap_err().to_string();
    assert!(err.contains("header of"), "{err}");
    assert!(load_bytes(&dir, &full[..5]).is_err());
    assert!(load_bytes(&dir, &[]).is_err());
}

/// A header entry: a name the loader looks for (or not), a dtype string (valid or not), a
/// shape and offsets from small to absurd.
fn header_entry() -> impl Strategy<Value = (String, serde_json::Value)> {
    let name = prop_oneof![
        Just("gate.weight".to_string()),
        Just("gate.bias".to_string()),
        Just("experts.w1".to_string()),
        Just("experts.w3".to_string()),
        Just("experts.w2".to_string()),
        Just("experts.0.w1.weight".to_string()),
        "[a-z.]{0,12}",
    ];
    let dim = prop_oneof![
        0usize..9,
        Just(usize::MAX),
        Just(1usize << 32),
        Just(1usize << 62),
        any::<usize>(),
    ];
    let offset = prop_oneof![0u64..300, any::<u64>()];
    let dtype = prop_oneof![
        Just("F32"),
        Just("BF16"),
        Just("F16"),
        Just("F64"),
        Just("I64"),
        Just("BOOL"),
        Just("F4"),
        Just("bf16"),
        Just(""),
    ];
    (
        name,
        dtype,
        proptest::collection::vec(dim, 0..4),
        (offset.clone(), offset),
    )
        .prop_map(|(name, dtype, shape, (a, b))| {
            let info =
                serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [a, b] });
            (name, info)
        })
}

fn with_header(header: &[u8], data_len: usize) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend((0..data_len).map(|i| i as u8));
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn a_truncated_file_is_an_error(cut in 0.0f64..1.0) {
        let dir = TempDir::new("truncated");
        let full = valid_file();
        let keep = ((full.len() as f64 * cut) as usize).min(full.len() - 1);
        prop_assert!(load_bytes(&dir, &full[..keep]).is_err());
    }

    #[test]
    fn any_header_length_is_handled(n in prop_oneof![any::<u64>(), 0u64..2048]) {
        let dir = TempDir::new("header-length");
        let mut bytes = valid_file();
        let real = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        bytes[..8].copy_from_slice(&n.to_le_bytes());
        let r = load_bytes(&dir, &bytes);
        prop_assert_eq!(r.is_ok(), n == real, "{:?}", r.err());
    }

    #[test]
    fn generated_headers_never_panic(
        entries in proptest::collection::vec(header_entry(), 0..6),
        data_len in 0usize..300,
    ) {
        let dir = TempDir::new("headers");
        let header: serde_json::Map<_, _> = entries.into_iter().collect();
        let header = serde_json::to_vec(&header).unwrap();
        let _ = load_bytes(&dir, &with_header(&header, data_len));
    }

    #[test]
    fn arbitrary_header_bytes_never_panic(
        header in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..200),
            "\\{[\"a-z0-9:,\\[\\]{} ]{0,80}\\}?".prop_map(String::into_bytes),
        ],
        data_len in 0usize..64,
    ) {
        let dir = TempDir::new("header-bytes");
        prop_assert!(load_bytes(&dir, &with_header(&header, data_len)).is_err());
    }

    #[test]
    fn broken_indexes_never_panic(
        map in proptest::collection::vec(
            (
                prop_oneof![
                    Just("gate.weight".to_string()),
                    Just("experts.w1".to_string()),
                    Just("experts.w3".to_string()),
                    Just("experts.w2".to_string()),
                    "[a-z.0-9]{0,12}",
                ],
                prop_oneof![
                    Just("good.safetensors".to_string()),
                    Just("missing.safetensors".to_string()),
                    Just("model.safetensors.index.json".to_string()),
                    Just("../good.safetensors".to_string()),
                    Just("/good.safetensors".to_string()),
                    Just(String::new()),
                    "[a-z./]{0,12}",
                ],
            ),
            0..8,
        ),
        raw in prop_oneof![Just(None), "[\\[\\]{}\":,a-z_ ]{0,40}".prop_map(Some)],
    ) {
        let dir = TempDir::new("index");
        std::fs::write(dir.join("good.safetensors"), valid_file()).unwrap();
        let index = dir.join("model.safetensors.index.json");
        match raw {
            Some(text) => std::fs::write(&index, text).unwrap(),
            None => {
                let map: Vec<(&str, &str)> =
                    map.iter().map(|(n, f)| (n.as_str(), f.as_str())).collect();
                write_index(&index, &map);
            }
        }
        let _ = WeightsFile::new(&dir.0).load(&tiny());
    }

    #[test]
    fn absurd_configs_never_panic(
        dims in proptest::collection::vec(
            prop_oneof![1usize..6, Just(usize::MAX), Just(1usize << 33), any::<usize>()],
            3,
        ),
    ) {
        let dir = TempDir::new("configs");
        let c = config(dims[0], dims[1], dims[2]);
        let r = load_bytes(&dir, &valid_file());
        let t = tiny();
        let same = (c.hidden, c.intermediate, c.experts) == (t.hidden, t.intermediate, t.experts);
        prop_assert!(r.is_ok());
        let path = dir.join("case.safetensors");
        prop_assert_eq!(WeightsFile::new(&path).load(&c).is_ok(), same);
    }
}
