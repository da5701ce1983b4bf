//! safetensors files: written straight from host slices with the checksum computed on the way and an
//! fsync at the end; read back only after the checksum verifies.
//!
//! The writer emits the standard format (8-byte little-endian header length, JSON header padded with
//! spaces to 8 bytes, contiguous data), so shards load in PyTorch (`safetensors.torch.load_file`) and the
//! HF ecosystem; reading goes through the `safetensors` crate, which validates every offset.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

use tch::Tensor;
use troupe_kernels::partition::balanced_range;
use troupe_kernels::{checksum64, Checksum64Stream};

use super::{io, CheckpointError};

#[cfg(not(target_endian = "little"))]
compile_error!("checkpoint files are written from memory as little-endian f32; add a byte swap for this target");

/// A tensor to write: its key, shape and values.
#[derive(Debug)]
pub struct FileTensor<'a> {
    pub key: String,
    pub shape: Vec<usize>,
    pub data: &'a [f32],
}

/// What was written: size and XXH3-64 of the whole file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    pub bytes: u64,
    pub checksum: u64,
}

/// Bytes per `write` call: large enough that the disk, not the syscalls, sets the pace.
const WRITE_CHUNK_BYTES: usize = 8 << 20;
/// Below this many bytes per thread a file is written by one thread.
const BYTES_PER_THREAD_MIN: u64 = 8 << 20;

/// Writes `tensors` (in order) to a new file at `path` and fsyncs it, with up to `threads` threads each
/// writing a contiguous part at its offset (copying into the page cache runs on several cores, as the
/// disk drains it) while this thread computes the checksum of the whole file in order.
pub fn write_f32_file(
    path: &Path,
    tensors: &[FileTensor<'_>],
    metadata: &BTreeMap<String, String>,
    threads: usize,
) -> Result<Written, CheckpointError> {
    let header = header_bytes(tensors, metadata);
    let prefix = (header.len() as u64).to_le_bytes();
    let mut segments: Vec<&[u8]> = vec![&prefix, &header];
    segments.extend(tensors.iter().map(|t| bytemuck_f32(t.data)));
    let bytes: u64 = segments.iter().map(|s| s.len() as u64).sum();
    let threads = threads.clamp(1, (bytes / BYTES_PER_THREAD_MIN).max(1) as usize);
    let file = File::create(path).map_err(io(path, "create"))?;
    let checksum = std::thread::scope(|scope| {
        let writers: Vec<_> = (0..threads)
            .map(|t| {
                let range = balanced_range(bytes as usize, threads, t);
                let (file, segments) = (&file, &segments);
                scope.spawn(move || write_range(file, segments, range))
            })
            .collect();
        let mut checksum = Checksum64Stream::new();
        for segment in &segments {
            checksum.update(segment);
        }
        for writer in writers {
            writer.join().expect("a file writer does not panic").map_err(io(path, "write"))?;
        }
        Ok::<u64, CheckpointError>(checksum.finish())
    })?;
    file.sync_all().map_err(io(path, "fsync"))?;
    Ok(Written { bytes, checksum })
}

/// Writes bytes `range` of the file made of `segments` (in order) at their offsets.
fn write_range(file: &File, segments: &[&[u8]], range: Range<usize>) -> std::io::Result<()> {
    let mut at = 0;
    for segment in segments {
        let start = range.start.max(at);
        let end = range.end.min(at + segment.len());
        let mut offset = start;
        while offset < end {
            let chunk_end = (offset + WRITE_CHUNK_BYTES).min(end);
            file.write_all_at(&segment[offset - at..chunk_end - at], offset as u64)?;
            offset = chunk_end;
        }
        at += segment.len();
    }
    Ok(())
}

/// The JSON header: every tensor `F32` at consecutive offsets, padded with spaces to a multiple of 8.
fn header_bytes(tensors: &[FileTensor<'_>], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + std::mem::size_of_val(t.data);
        header.insert(
            t.key.clone(),
            serde_json::json!({ "dtype": "F32", "shape": t.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut bytes = serde_json::to_vec(&header).expect("a map of strings and numbers serialises");
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    bytes
}

/// The bytes of an `f32` slice (little-endian on every target this compiles for).
fn bytemuck_f32(data: &[f32]) -> &[u8] {
    bytemuck::cast_slice(data)
}

/// Reads a whole file and checks its length and checksum against what the manifest recorded.
pub fn read_verified(dir: &Path, name: &str, bytes: u64, checksum: u64) -> Result<Vec<u8>, CheckpointError> {
    let path = dir.join(name);
    let data = std::fs::read(&path).map_err(io(&path, "read"))?;
    if data.len() as u64 != bytes {
        let (expected, found) = (bytes, data.len() as u64);
        return Err(CheckpointError::Length { path: dir.to_owned(), file: name.to_owned(), expected, found });
    }
    let found = checksum64(&data);
    if found != checksum {
        return Err(CheckpointError::Checksum {
            path: dir.to_owned(),
            file: name.to_owned(),
            expected: checksum,
            found,
        });
    }
    Ok(data)
}

/// Parses a verified safetensors buffer (the crate validates the header and every offset).
pub fn parse<'a>(path: &Path, buffer: &'a [u8]) -> Result<safetensors::SafeTensors<'a>, CheckpointError> {
    safetensors::SafeTensors::deserialize(buffer).map_err(|e| CheckpointError::Tensors {
        path: path.to_owned(),
        message: format!("not a safetensors file: {e}"),
    })
}

/// Copies the `f32` values of tensor `key` of `file`, elements `elements` (of its flattened form), into `out`.
pub fn copy_f32(
    path: &Path,
    file: &safetensors::SafeTensors<'_>,
    key: &str,
    elements: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<(), CheckpointError> {
    let bad = |message: String| CheckpointError::Tensors { path: path.to_owned(), message };
    let view = file.tensor(key).map_err(|e| bad(format!("tensor {key}: {e}")))?;
    if view.dtype() != safetensors::Dtype::F32 {
        return Err(bad(format!("tensor {key} is {:?}, expected F32", view.dtype())));
    }
    let data = view.data();
    let Some(bytes) = data.get(elements.start * 4..elements.end * 4) else {
        return Err(bad(format!("tensor {key} has {} elements, the manifest reads {elements:?}", data.len() / 4)));
    };
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

/// Writes named libtorch tensors to a safetensors file and fsyncs it (`--save-final`: parameters alone).
pub fn write_tensors(path: &Path, tensors: Vec<(String, Tensor)>) -> Result<(), CheckpointError> {
    Tensor::write_safetensors(&tensors, path)
        .map_err(|e| CheckpointError::Tensors { path: path.to_owned(), message: e.to_string() })?;
    File::open(path).and_then(|f| f.sync_all()).map_err(io(path, "fsync"))
}

/// Writes `bytes` to a new file and fsyncs it.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io(path, "create"))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(io(path, "write"))
}
