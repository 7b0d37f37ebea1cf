//! A layer's tensors from safetensors: one file, or a Hugging Face sharded checkpoint (shards
//! beside a `model.safetensors.index.json` whose `weight_map` names each tensor's shard). The
//! files are memory-mapped: only headers and the chosen layer's tensors are read, and every
//! size is checked against its file before anything is read or allocated, so no file can make
//! the loader panic or abort.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::Metadata;
use safetensors::Dtype;

use crate::device::mapped::MappedFile;
use crate::error::{Error, Result};
use crate::moe::MoeConfig;

use super::HostWeights;

/// The index Hugging Face writes beside the shards of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The file a folder holds when its checkpoint is not sharded.
const SINGLE_FILE: &str = "model.safetensors";
/// The largest safetensors header (and index file) read: the format's own header limit.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Where a layer's tensors are in a safetensors checkpoint, and how strictly to read them.
///
/// The path is one `.safetensors` file, a sharded checkpoint's `model.safetensors.index.json`,
/// or a folder holding either that index or `model.safetensors`.
///
/// A checkpoint holds many layers; one MoE block is the tensors under one prefix (everything
/// before an `experts` part of their names, e.g. `model.layers.3.mlp.`). Name it with
/// [`prefix`](Self::prefix) or [`layer`](Self::layer); without either, a checkpoint with more
/// than one block is an error that lists them. Under the prefix the loader reads stacked
/// `gate.weight` [E, H], `experts.w1` / `experts.w3` [E, I, H], `experts.w2` [E, H, I], or per
/// expert `experts.{e}.w1.weight` (or `.gate_proj.weight`), `w3` (`up_proj`), `w2`
/// (`down_proj`), stacked here; and the optional router bias `gate.bias` (or DeepSeek-V3's
/// `gate.e_score_correction_bias`) \[E\]. f32, f16 and bf16 tensors are converted. A missing
/// or mis-shaped tensor is an error naming it.
///
/// The files are memory-mapped while they are read, and must not change meanwhile: a file
/// truncated by another process during a load ends the process (SIGBUS), one rewritten
/// loads whatever bytes it held when read. A [`MoeLayer`](crate::moe::MoeLayer) built from
/// the file keeps its tensors' dtype from the mapping to the device (through the staging
/// ring of `transfer::upload`), converting on the copy threads only where the file's dtype
/// is not the layer's; [`load`](Self::load) gives them as f32 on the host.
///
/// NaN and infinity are counted per tensor: by default each tensor holding any is logged
/// with `tracing::warn!`; with [`strict`](Self::strict) the load fails naming the tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsFile {
    path: PathBuf,
    block: Block,
    strict: bool,
}

/// Which MoE block of a checkpoint to read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Block {
    /// The only one there is.
    Only,
    /// The one under this prefix (empty, or ending in `.`).
    Prefix(String),
    /// The one whose prefix has this index as one of its dot-separated parts.
    Layer(usize),
}

impl WeightsFile {
    /// The checkpoint at `path` (a file, an index or a folder); its only MoE block, leniently.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        WeightsFile {
            path: path.into(),
            block: Block::Only,
            strict: false,
        }
    }

    /// Reads the block whose tensor names start with `prefix` (a missing final `.` is added;
    /// empty means names with no prefix, such as `gate.weight`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        let mut prefix = prefix.into();
        if !prefix.is_empty() && !prefix.ends_with('.') {
            prefix.push('.');
        }
        self.block = Block::Prefix(prefix);
        self
    }

    /// Reads the block of layer `index`: the one prefix with `index` as one of its
    /// dot-separated parts (`model.layers.{index}.mlp.`, `...{index}.block_sparse_moe.`).
    pub fn layer(mut self, index: usize) -> Self {
        self.block = Block::Layer(index);
        self
    }

    /// Whether a tensor holding NaN or infinity fails the load (else it is logged).
    pub fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// The checkpoint's path as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the tensors `config` needs (see [`WeightsFile`]) as f32.
    pub fn load(&self, config: &MoeConfig) -> Result<HostWeights> {
        let (ckpt, t) = self.locate(config)?;
        let weights = HostWeights {
            gate: self.read(&ckpt, std::slice::from_ref(&t.gate))?,
            gate_bias: t.gate_bias.map(|b| self.read(&ckpt, &[b])).transpose()?,
            w1: self.read(&ckpt, &t.w1)?,
            w3: self.read(&ckpt, &t.w3)?,
            w2: self.read(&ckpt, &t.w2)?,
        };
        weights.check(config)?;
        Ok(weights)
    }

    /// The checkpoint (its shards opened) and where in it the tensors `config` needs are,
    /// their shapes and dtypes checked.
    pub(super) fn locate(&self, config: &MoeConfig) -> Result<(Checkpoint, LayerTensors)> {
        let mut ckpt = Checkpoint::open(&self.path)?;
        let prefix = self.choose(&ckpt.blocks())?;
        let (h, i, e) = (config.hidden, config.intermediate, config.experts);
        let missing = |name: &str| {
            Error::InvalidArgument(format!(
                "{}: tensor `{prefix}{name}` is missing (MoE weights need gate.weight and the \
                 experts' w1, w3, w2)",
                self.path.display()
            ))
        };
        let gate = ckpt
            .find(&format!("{prefix}gate.weight"), &[e, h])?
            .ok_or_else(|| missing("gate.weight"))?;
        let mut gate_bias = None;
        for name in ["gate.bias", "gate.e_score_correction_bias"] {
            gate_bias = ckpt.find(&format!("{prefix}{name}"), &[e])?;
            if gate_bias.is_some() {
                break;
            }
        }
        let mut stacked = |which: &str, alt: &str, dims: [usize; 2]| -> Result<Vec<Located>> {
            if let Some(t) =
                ckpt.find(&format!("{prefix}experts.{which}"), &[e, dims[0], dims[1]])?
            {
                return Ok(vec![t]);
            }
            // One tensor per expert; the loop ends at the first one the checkpoint lacks.
            let mut out = Vec::new();
            for x in 0..e {
                let mut found = None;
                for name in [which, alt] {
                    found = ckpt.find(&format!("{prefix}experts.{x}.{name}.weight"), &dims)?;
                    if found.is_some() {
                        break;
                    }
                }
                out.push(found.ok_or_else(|| missing(&format!("experts.{x}.{which}.weight")))?);
            }
            Ok(out)
        };
        let w1 = stacked("w1", "gate_proj", [i, h])?;
        let w3 = stacked("w3", "up_proj", [i, h])?;
        let w2 = stacked("w2", "down_proj", [h, i])?;
        let tensors = LayerTensors {
            gate,
            gate_bias,
            w1,
            w3,
            w2,
        };
        Ok((ckpt, tensors))
    }

    /// The prefix of the block to read, from those the checkpoint holds.
    fn choose(&self, blocks: &BTreeSet<String>) -> Result<String> {
        let list = |blocks: &mut dyn Iterator<Item = &String>| -> String {
            let names: Vec<String> = blocks.map(|b| format!("`{b}`")).collect();
            if names.is_empty() {
                "none".into()
            } else {
                names.join(", ")
            }
        };
        let path = self.path.display();
        match &self.block {
            Block::Only => match blocks.len() {
                // No `experts` names: the lookups under no prefix name what is missing.
                0 => Ok(String::new()),
                1 => Ok(blocks.iter().next().cloned().unwrap_or_default()),
                n => Err(Error::InvalidArgument(format!(
                    "{path} holds {n} MoE blocks ({}): name one by its prefix or layer index",
                    list(&mut blocks.iter())
                ))),
            },
            Block::Prefix(p) if blocks.contains(p) => Ok(p.clone()),
            Block::Prefix(p) => Err(Error::InvalidArgument(format!(
                "{path} holds no MoE block under prefix `{p}`; its blocks: {}",
                list(&mut blocks.iter())
            ))),
            Block::Layer(n) => {
                let n = n.to_string();
                let hits: Vec<&String> = blocks
                    .iter()
                    .filter(|b| b.split('.').any(|part| part == n))
                    .collect();
                match hits.as_slice() {
                    [one] => Ok((*one).clone()),
                    [] => Err(Error::InvalidArgument(format!(
                        "{path} holds no MoE block of layer {n}; its blocks: {}",
                        list(&mut blocks.iter())
                    ))),
                    _ => Err(Error::InvalidArgument(format!(
                        "{path} holds several MoE blocks of layer {n} ({}): name one by its \
                         prefix",
                        list(&mut hits.into_iter())
                    ))),
                }
            }
        }
    }

    /// The values of `tensors`, one after another, as f32; non-finite values are counted per
    /// tensor and logged, or refused when strict.
    pub(super) fn read(&self, ckpt: &Checkpoint, tensors: &[Located]) -> Result<Vec<f32>> {
        let total = tensors
            .iter()
            .try_fold(0usize, |sum, t| sum.checked_add(t.elements))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: the tensors' sizes overflow",
                    self.path.display()
                ))
            })?;
        let mut out = Vec::new();
        reserve(&mut out, total, &self.path)?;
        for t in tensors {
            let bytes = ckpt.bytes(t)?;
            let start = out.len();
            extend_f32(&mut out, t.dtype, bytes);
            let bad = out[start..].iter().filter(|v| !v.is_finite()).count();
            self.non_finite(t, bad)?;
        }
        Ok(out)
    }

    /// Logs that `t` holds `bad` non-finite values, or refuses it when strict (nothing when
    /// `bad` is 0).
    pub(super) fn non_finite(&self, t: &Located, bad: usize) -> Result<()> {
        if bad == 0 {
            return Ok(());
        }
        let what = format!(
            "{}: `{}` holds {bad} non-finite values (NaN or infinity) of {}",
            t.shard.display(),
            t.name,
            t.elements
        );
        if self.strict {
            return Err(Error::InvalidArgument(what));
        }
        tracing::warn!("{what}; loading it anyway (strict loading refuses it)");
        Ok(())
    }
}

/// Where a layer's tensors are: the expert weights as one stacked tensor or one per expert.
pub(super) struct LayerTensors {
    pub(super) gate: Located,
    pub(super) gate_bias: Option<Located>,
    pub(super) w1: Vec<Located>,
    pub(super) w3: Vec<Located>,
    pub(super) w2: Vec<Located>,
}

/// A tensor found in a checkpoint, its shape checked.
pub(super) struct Located {
    pub(super) name: String,
    pub(super) shard: PathBuf,
    pub(super) dtype: Dtype,
    pub(super) elements: usize,
}

/// A checkpoint's tensor names, the file holding each, and the files opened so far.
pub(super) struct Checkpoint {
    /// The index file (or the one file) that named the tensors: what messages cite.
    origin: PathBuf,
    shard_of: HashMap<String, PathBuf>,
    open: HashMap<PathBuf, Shard>,
}

impl Checkpoint {
    fn open(path: &Path) -> Result<Checkpoint> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            let index = path.join(INDEX_FILE);
            if index.is_file() {
                return Checkpoint::sharded(&index);
            }
            let single = path.join(SINGLE_FILE);
            if single.is_file() {
                return Checkpoint::single(&single);
            }
            return Err(Error::InvalidArgument(format!(
                "{}: a folder with neither {INDEX_FILE} nor {SINGLE_FILE}",
                path.display()
            )));
        }
        if path.extension().is_some_and(|x| x == "json") {
            Checkpoint::sharded(path)
        } else {
            Checkpoint::single(path)
        }
    }

    fn single(path: &Path) -> Result<Checkpoint> {
        let shard = Shard::open(path)?;
        let shard_of = shard
            .meta
            .tensors()
            .into_keys()
            .map(|name| (name, path.to_path_buf()))
            .collect();
        Ok(Checkpoint {
            origin: path.to_path_buf(),
            shard_of,
            open: HashMap::from([(path.to_path_buf(), shard)]),
        })
    }

    fn sharded(index: &Path) -> Result<Checkpoint> {
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        let bad = |m: String| Error::InvalidArgument(format!("{}: {m}", index.display()));
        let mut file = File::open(index).map_err(|e| Error::io(index, e))?;
        let len = file.metadata().map_err(|e| Error::io(index, e))?.len();
        if len > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "an index of {len} bytes, over the {MAX_HEADER_BYTES}-byte limit"
            )));
        }
        let mut text = Vec::new();
        file.read_to_end(&mut text)
            .map_err(|e| Error::io(index, e))?;
        let parsed: Index = serde_json::from_slice(&text)
            .map_err(|e| bad(format!("not a safetensors index (`weight_map`): {e}")))?;
        let dir = index.parent().unwrap_or(Path::new(""));
        let mut shard_of = HashMap::with_capacity(parsed.weight_map.len());
        for (name, shard) in parsed.weight_map {
            // Shards sit beside the index: a path elsewhere is refused, not followed.
            let mut parts = Path::new(&shard).components();
            if !matches!(
                (parts.next(), parts.next()),
                (Some(Component::Normal(_)), None)
            ) {
                return Err(bad(format!(
                    "`{name}` is in shard `{shard}`, which is not a file name beside the index"
                )));
            }
            shard_of.insert(name, dir.join(shard));
        }
        Ok(Checkpoint {
            origin: index.to_path_buf(),
            shard_of,
            open: HashMap::new(),
        })
    }

    /// The prefixes of the MoE blocks: what comes before an `experts` part of a name.
    fn blocks(&self) -> BTreeSet<String> {
        self.shard_of
            .keys()
            .filter_map(|name| block_prefix(name))
            .map(str::to_string)
            .collect()
    }

    /// Tensor `name` if the checkpoint has it; an error if its shape is not `dims` or its
    /// dtype is not a float the loader converts.
    fn find(&mut self, name: &str, dims: &[usize]) -> Result<Option<Located>> {
        let Some(path) = self.shard_of.get(name) else {
            return Ok(None);
        };
        let path = path.clone();
        let origin = self.origin.display().to_string();
        let shard = self.shard(&path)?;
        let Some(info) = shard.meta.info(name) else {
            return Err(Error::InvalidArgument(format!(
                "{origin}: `{name}` is in {}, which does not hold it",
                path.display()
            )));
        };
        let at = path.display();
        if info.shape != dims {
            return Err(Error::InvalidArgument(format!(
                "{at}: `{name}` has shape {:?}, {dims:?} expected",
                info.shape
            )));
        }
        let width = match info.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "{at}: `{name}`: dtype {other:?} is not f32, f16 or bf16"
                )))
            }
        };
        // The header's validation ties the byte range to the shape, so this is the element count.
        let (begin, end) = info.data_offsets;
        let elements = end.saturating_sub(begin) / width;
        Ok(Some(Located {
            name: name.to_string(),
            shard: path,
            dtype: info.dtype,
            elements,
        }))
    }

    fn shard(&mut self, path: &Path) -> Result<&mut Shard> {
        if !self.open.contains_key(path) {
            let shard = Shard::open(path)?;
            self.open.insert(path.to_path_buf(), shard);
        }
        self.open
            .get_mut(path)
            .ok_or_else(|| Error::InvalidArgument(format!("{}: shard not opened", path.display())))
    }

    /// The bytes of a tensor [`find`](Self::find) located, in the mapped file.
    pub(super) fn bytes(&self, t: &Located) -> Result<&[u8]> {
        self.open
            .get(&t.shard)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{}: shard not opened", t.shard.display()))
            })?
            .bytes(&t.shard, &t.name)
    }
}

/// An open safetensors file: its mapping, parsed header and where its data starts.
struct Shard {
    map: MappedFile,
    meta: Metadata,
    data_start: usize,
}

impl Shard {
    /// Reads and checks the header: its length within the format's limit and the file, and
    /// the tensors' byte ranges (contiguous, matching their shapes) covering the data exactly.
    fn open(path: &Path) -> Result<Shard> {
        let bad = |m: String| {
            Error::InvalidArgument(format!("{}: not a safetensors file: {m}", path.display()))
        };
        let map = MappedFile::open(path)?;
        let file = map.bytes();
        let file_len = file.len() as u64;
        let Some((n, rest)) = file.split_first_chunk::<8>() else {
            return Err(bad(format!(
                "{file_len} bytes, shorter than the header's length"
            )));
        };
        let header_len = u64::from_le_bytes(*n);
        if header_len > MAX_HEADER_BYTES {
            return Err(bad(format!(
                "a header of {header_len} bytes, over the format's {MAX_HEADER_BYTES}-byte limit"
            )));
        }
        // Under the limit, so it fits a usize.
        let Some(header) = rest.get(..header_len as usize) else {
            return Err(bad(format!(
                "a header of {header_len} bytes in a file of {file_len}"
            )));
        };
        let meta: Metadata =
            serde_json::from_slice(header).map_err(|e| bad(format!("header: {e}")))?;
        let data_start = 8 + header.len();
        let data_len = file.len() - data_start;
        if meta.data_len() != data_len {
            return Err(bad(format!(
                "the header's tensors span {} bytes, the file holds {data_len} after the header",
                meta.data_len()
            )));
        }
        Ok(Shard {
            map,
            meta,
            data_start,
        })
    }

    fn bytes(&self, path: &Path, name: &str) -> Result<&[u8]> {
        let (begin, end) = self
            .meta
            .info(name)
            .map(|info| info.data_offsets)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{}: no tensor `{name}`", path.display()))
            })?;
        // `open` checked that every range lies inside the file; checked again, not trusted.
        self.data_start
            .checked_add(begin)
            .zip(self.data_start.checked_add(end))
            .and_then(|(b, e)| self.map.bytes().get(b..e))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: `{name}` lies past the end of the file",
                    path.display()
                ))
            })
    }
}

/// Room for `n` more values, or an error instead of the allocator aborting the process.
fn reserve<T>(v: &mut Vec<T>, n: usize, path: &Path) -> Result<()> {
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        requested: n.saturating_mul(std::mem::size_of::<T>()),
        detail: format!("host memory for the weights of {}", path.display()),
    })
}

/// What comes before the first `experts` part of `name` (`model.layers.3.mlp.` for
/// `model.layers.3.mlp.experts.0.w1.weight`, empty for `experts.w1`), if it has one.
fn block_prefix(name: &str) -> Option<&str> {
    let mut at = 0;
    for part in name.split('.') {
        if part == "experts" {
            return name.get(..at);
        }
        at += part.len() + 1;
    }
    None
}

/// Appends little-endian `data` of a float `dtype` as f32 (other dtypes append nothing:
/// [`Checkpoint::find`] refuses them).
fn extend_f32(out: &mut Vec<f32>, dtype: Dtype, data: &[u8]) {
    let pairs = data
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]));
    match dtype {
        Dtype::F32 => out.extend(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        Dtype::F16 => out.extend(pairs.map(|u| f16::from_bits(u).to_f32())),
        Dtype::BF16 => out.extend(pairs.map(|u| bf16::from_bits(u).to_f32())),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_prefixes_end_before_experts() {
        assert_eq!(block_prefix("experts.w1"), Some(""));
        assert_eq!(
            block_prefix("model.layers.3.mlp.experts.0.w1.weight"),
            Some("model.layers.3.mlp.")
        );
        assert_eq!(
            block_prefix("model.layers.0.block_sparse_moe.experts.7.w2.weight"),
            Some("model.layers.0.block_sparse_moe.")
        );
        // Shared experts and routers are not the routed experts' block.
        assert_eq!(
            block_prefix("model.layers.3.mlp.shared_experts.up_proj.weight"),
            None
        );
        assert_eq!(block_prefix("model.layers.3.mlp.gate.weight"), None);
    }

    #[test]
    fn a_layer_index_matches_a_whole_part_of_the_prefix() {
        let blocks: BTreeSet<String> = ["model.layers.3.mlp.", "model.layers.13.mlp."]
            .map(String::from)
            .into();
        let pick = |f: WeightsFile| f.choose(&blocks);
        let f = WeightsFile::new("x.safetensors");
        assert_eq!(pick(f.clone().layer(3)).unwrap(), "model.layers.3.mlp.");
        assert_eq!(pick(f.clone().layer(13)).unwrap(), "model.layers.13.mlp.");
        assert_eq!(
            pick(f.clone().prefix("model.layers.13.mlp")).unwrap(),
            "model.layers.13.mlp."
        );
        let err = pick(f.clone().layer(1)).unwrap_err().to_string();
        assert!(err.contains("model.layers.13.mlp."), "{err}");
        let err = pick(f).unwrap_err().to_string();
        assert!(
            err.contains("`model.layers.3.mlp.`") && err.contains("`model.layers.13.mlp.`"),
            "{err}"
        );
    }
}
