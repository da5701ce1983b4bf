//! Reading Hugging Face weights: `model.safetensors`, or the shards `model.safetensors.index.json` names.
//! Each tensor is read by its byte range (`pread`), so a rank that holds a pipeline stage or a ZeRO-3
//! shard reads those tensors and no others — never the whole model on every rank. F32, BF16 and F16 are
//! widened to fp32.
//!
//! This is the bottom of the Hugging Face boundary: tensors by their names in the files, and
//! [`HfError`], the boundary's one error. It knows no model: which tensor a parameter is stored as
//! ([`crate::model::file_name`]) is the model's, and `config.json`, the export and PEFT's adapters
//! ([`crate::hf`]) are above the model.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use serde_json::Value;

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";
/// Largest safetensors header read (safetensors' own limit).
const HEADER_BYTES_MAX: u64 = 100_000_000;

/// What a Hugging Face directory or file that cannot be used gets: the file, the tensor or the key, and
/// what was expected.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{dir}: no model.safetensors or model.safetensors.index.json; a Hugging Face model directory holds one (save_pretrained writes it)")]
    NoWeights { dir: PathBuf },
    #[error("{index}: names the file {file} for tensor {tensor}, but {file} is not in {dir}")]
    MissingShard { index: PathBuf, dir: PathBuf, file: String, tensor: String },
    #[error("{dir}: the weights have no tensor {tensor} (expected {shape:?}); the directory does not hold the model its config.json describes")]
    MissingTensor { dir: PathBuf, tensor: String, shape: Vec<i64> },
    #[error(
        "{path}: tensor {tensor} has shape {found:?}, expected {expected:?} for the model of config.json and [model]"
    )]
    Shape { path: PathBuf, tensor: String, found: Vec<usize>, expected: Vec<usize> },
    #[error(
        "{path}: tensor {tensor} is not a parameter of a {arch} model of this shape; remove it or check config.json"
    )]
    Unexpected { path: PathBuf, tensor: String, arch: &'static str },
    #[error("{path}: tensor {tensor} is {dtype}; troupe reads F32, BF16 and F16 weights")]
    Dtype { path: PathBuf, tensor: String, dtype: String },
    #[error("{path}: architecture {found:?} is not one troupe builds; supported: {supported}")]
    Architecture { path: PathBuf, found: String, supported: String },
    #[error("{path}: {key} = {value} is not supported: {why}")]
    Unsupported { path: PathBuf, key: String, value: String, why: String },
    #[error(
        "[model] {key} = {toml} disagrees with {path}: {json_key} = {json}; remove the key from [model] or correct it"
    )]
    Disagrees { key: String, toml: String, path: PathBuf, json_key: String, json: String },
}

/// One tensor in a file: its dtype, shape and absolute byte range.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: String,
    shape: Vec<usize>,
    start: u64,
    end: u64,
}

/// The weights of a Hugging Face model directory, by tensor name; files are read on demand.
#[derive(Debug)]
pub struct HfWeights {
    dir: PathBuf,
    files: Vec<(PathBuf, File)>,
    entries: BTreeMap<String, Entry>,
}

impl HfWeights {
    /// Opens `dir`'s weights: checks the index (every file it names exists) and every file's header
    /// (well-formed, every tensor's range inside a file of exactly the size the header implies — a
    /// truncated shard is named here).
    pub fn open(dir: &Path) -> Result<Self, HfError> {
        let index = dir.join(INDEX);
        let single = dir.join(SINGLE);
        let names: Vec<String> = if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|source| HfError::Io { path: index.clone(), source })?;
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| HfError::Format { path: index.clone(), message: format!("not JSON: {e}") })?;
            let map = value.get("weight_map").and_then(Value::as_object).ok_or_else(|| HfError::Format {
                path: index.clone(),
                message: "has no \"weight_map\" object (tensor name → file)".into(),
            })?;
            let mut files: Vec<String> = Vec::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| HfError::Format {
                    path: index.clone(),
                    message: format!("weight_map[{tensor:?}] is not a file name"),
                })?;
                if file.contains('/') || !dir.join(file).is_file() {
                    return Err(HfError::MissingShard {
                        index: index.clone(),
                        dir: dir.to_owned(),
                        file: file.to_owned(),
                        tensor: tensor.clone(),
                    });
                }
                if !files.iter().any(|f| f == file) {
                    files.push(file.to_owned());
                }
            }
            files.sort();
            files
        } else if single.is_file() {
            vec![SINGLE.to_owned()]
        } else {
            return Err(HfError::NoWeights { dir: dir.to_owned() });
        };
        let mut weights = Self { dir: dir.to_owned(), files: Vec::new(), entries: BTreeMap::new() };
        for name in names {
            weights.add_file(&dir.join(name))?;
        }
        Ok(weights)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), HfError> {
        let io = |source| HfError::Io { path: path.to_owned(), source };
        let format = |message: String| HfError::Format { path: path.to_owned(), message };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|_| format(format!("{len} bytes: too short for a safetensors header")))?;
        let n = u64::from_le_bytes(n);
        if n > HEADER_BYTES_MAX || 8 + n > len {
            return Err(format(format!("header of {n} bytes does not fit the file's {len} bytes (truncated?)")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(io)?;
        let header: HashMap<String, Value> =
            serde_json::from_slice(&header).map_err(|e| format(format!("header is not a JSON object: {e}")))?;
        let data_start = 8 + n;
        let mut data_end = 0u64;
        let index = self.files.len();
        for (name, info) in header {
            if name == "__metadata__" {
                continue;
            }
            let bad = || format(format!("header entry {name:?} lacks dtype, shape or data_offsets"));
            let dtype = info.get("dtype").and_then(Value::as_str).ok_or_else(bad)?.to_owned();
            let shape: Vec<usize> = info
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(bad)?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<_>>()
                .ok_or_else(bad)?;
            let offsets = info.get("data_offsets").and_then(Value::as_array).ok_or_else(bad)?;
            let (Some(start), Some(end)) =
                (offsets.first().and_then(Value::as_u64), offsets.get(1).and_then(Value::as_u64))
            else {
                return Err(bad());
            };
            let width = dtype_bytes(&dtype).unwrap_or(1) as u64;
            let numel: u64 = shape.iter().map(|&d| d as u64).product();
            if end < start || (dtype_bytes(&dtype).is_some() && end - start != numel * width) {
                return Err(format(format!(
                    "tensor {name}: data_offsets [{start}, {end}] do not hold shape {shape:?} of {dtype}"
                )));
            }
            data_end = data_end.max(end);
            self.entries
                .insert(name, Entry { file: index, dtype, shape, start: data_start + start, end: data_start + end });
        }
        if data_start + data_end != len {
            return Err(format(format!(
                "the header describes {} bytes of tensor data but the file holds {}: truncated or corrupt; download it again",
                data_end,
                len - data_start
            )));
        }
        self.files.push((path.to_owned(), file));
        Ok(())
    }

    fn read_entry(&self, name: &str, entry: &Entry) -> Result<(Vec<f32>, Vec<usize>), HfError> {
        let (path, file) = &self.files[entry.file];
        let mut bytes = vec![0u8; (entry.end - entry.start) as usize];
        file.read_exact_at(&mut bytes, entry.start).map_err(|source| HfError::Io { path: path.clone(), source })?;
        let values = match entry.dtype.as_str() {
            "F32" => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            "BF16" => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            "F16" => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => {
                return Err(HfError::Dtype { path: path.clone(), tensor: name.to_owned(), dtype: other.to_owned() })
            }
        };
        Ok((values, entry.shape.clone()))
    }

    /// Where the tensor troupe holds as `shape` is: stored as `name` (a GPT-2 file written by
    /// `GPT2Model`, or an original checkpoint, lacks the `transformer.` prefix), `[in, out]` where
    /// `transposed`; its name as found and its entry, the shape checked.
    fn locate(&self, name: &str, transposed: bool, shape: &[i64]) -> Result<(String, &Entry), HfError> {
        let bare = name.strip_prefix("transformer.").unwrap_or(name).to_owned();
        let Some((name, entry)) =
            [name.to_owned(), bare].into_iter().find_map(|n| self.entries.get(&n).map(|e| (n, e)))
        else {
            return Err(HfError::MissingTensor {
                dir: self.dir.clone(),
                tensor: name.to_owned(),
                shape: shape.to_vec(),
            });
        };
        let mut expected: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        if transposed {
            expected.reverse();
        }
        if entry.shape != expected {
            let path = self.files[entry.file].0.clone();
            return Err(HfError::Shape { path, tensor: name, found: entry.shape.clone(), expected });
        }
        Ok((name, entry))
    }

    /// The tensor troupe holds as `shape`, stored as `name` (`[in, out]` where `transposed`), as fp32 in
    /// troupe's layout (transposed back), its shape checked.
    pub fn read(&self, name: &str, transposed: bool, shape: &[i64]) -> Result<Vec<f32>, HfError> {
        let (name, entry) = self.locate(name, transposed, shape)?;
        let (values, shape) = self.read_entry(&name, entry)?;
        if !transposed {
            return Ok(values);
        }
        Ok(transpose(&values, shape[0], shape[1]))
    }

    /// Checks, reading the headers only, that the files hold exactly `params` (each stored as its name,
    /// `[in, out]` where transposed, troupe's shape): every one present with its shape and a dtype
    /// [`Self::read`] widens, and no other tensor than the buffers older versions saved and those
    /// `also_allowed` names. `arch` names the model in the error.
    pub fn check_exactly<'a>(
        &self,
        params: impl IntoIterator<Item = (String, bool, &'a [i64])>,
        also_allowed: impl Fn(&str) -> bool,
        arch: &'static str,
    ) -> Result<(), HfError> {
        let mut used = std::collections::HashSet::new();
        for (name, transposed, shape) in params {
            let (name, entry) = self.locate(&name, transposed, shape)?;
            let path = self.files[entry.file].0.clone();
            if !matches!(entry.dtype.as_str(), "F32" | "BF16" | "F16") {
                return Err(HfError::Dtype { path, tensor: name, dtype: entry.dtype.clone() });
            }
            used.insert(name);
        }
        for (name, entry) in &self.entries {
            if !used.contains(name) && !is_buffer(name) && !also_allowed(name) {
                let path = self.files[entry.file].0.clone();
                return Err(HfError::Unexpected { path, tensor: name.clone(), arch });
            }
        }
        Ok(())
    }
}

fn dtype_bytes(dtype: &str) -> Option<usize> {
    match dtype {
        "F64" | "I64" | "U64" => Some(8),
        "F32" | "I32" | "U32" => Some(4),
        "F16" | "BF16" | "I16" | "U16" => Some(2),
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => Some(1),
        _ => None,
    }
}

/// Tensors a Hugging Face file may hold that are not parameters (buffers older versions saved).
fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias") && !name.contains(".c_attn.")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with(".rotary_emb.inv_freq")
}

/// A row-major `[rows, cols]` matrix as row-major `[cols, rows]`.
pub(crate) fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}
