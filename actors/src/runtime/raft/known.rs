//! The daemons a node last knew (the members of the last view it adopted, with their control
//! addresses), kept in its data dir across restarts: a member restarted after the controller its `join`
//! names is gone for good tries them — any daemon redirects it to the controller (issue 32; before, it
//! knew no other to dial). Best effort: a file that cannot be read or written is logged, never fatal.

use std::path::{Path, PathBuf};

use crate::protocol::MemberInfo;

/// The file in the data dir.
const FILE: &str = "known-daemons.json";
/// At most this many are kept (a view is bounded by the cluster's size; this bounds the file).
const KNOWN_MAX: usize = 1024;

fn path(data_dir: &Path) -> PathBuf {
    data_dir.join(FILE)
}

/// Replaces the daemons kept with `members` (written to a temporary file, then renamed over it).
pub fn save(data_dir: &Path, members: &[MemberInfo]) {
    let members = &members[..members.len().min(KNOWN_MAX)];
    let (file, tmp) = (path(data_dir), data_dir.join(format!("{FILE}.tmp")));
    let written = serde_json::to_vec(members)
        .map_err(std::io::Error::other)
        .and_then(|bytes| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, &file));
    if let Err(e) = written {
        tracing::warn!(file = %file.display(), "keeping the daemons this node knows: {e}");
    }
}

/// The daemons kept by an earlier run; none if there is no file (a first start) or it is unreadable.
pub fn load(data_dir: &Path) -> Vec<MemberInfo> {
    let file = path(data_dir);
    let Ok(bytes) = std::fs::read(&file) else { return Vec::new() };
    match serde_json::from_slice::<Vec<MemberInfo>>(&bytes) {
        Ok(mut members) => {
            members.truncate(KNOWN_MAX);
            members
        }
        Err(e) => {
            tracing::warn!(file = %file.display(), "ignored the daemons kept by an earlier run: {e}");
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_daemons_kept_are_read_back_and_a_bad_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).is_empty(), "a first start knows none");
        let members = vec![
            MemberInfo {
                name: "node-1".into(),
                addr: "127.0.0.1:7001".parse().unwrap(),
                slots: 1,
                dashboard: None,
                raft_listen: None,
                devices: Vec::new(),
                load: None,
            },
            MemberInfo {
                name: "node-2".into(),
                addr: "127.0.0.1:7002".parse().unwrap(),
                slots: 0,
                dashboard: None,
                raft_listen: None,
                devices: Vec::new(),
                load: None,
            },
        ];
        save(dir.path(), &members);
        assert_eq!(load(dir.path()), members);
        std::fs::write(dir.path().join(FILE), b"not json").unwrap();
        assert!(load(dir.path()).is_empty());
    }
}
