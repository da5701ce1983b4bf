use std::fmt;

use serde::{Deserialize, Serialize};

/// A node's stable identity: the name in its certificate. Ranks follow the order of these names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub String);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for NodeId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

/// The membership epoch. Every message carries the epoch of the view its sender acts on; every change of
/// the view increments it by exactly one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Epoch(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Who is in the job at an epoch. Members are sorted by node id; a member's rank is its index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    pub epoch: Epoch,
    members: Vec<NodeId>,
}

impl View {
    pub fn new(epoch: Epoch, mut members: Vec<NodeId>) -> Self {
        members.sort();
        members.dedup();
        Self { epoch, members }
    }

    pub fn members(&self) -> &[NodeId] {
        &self.members
    }

    pub fn contains(&self, node: &NodeId) -> bool {
        self.members.binary_search(node).is_ok()
    }

    /// The rank of `node` in this view (its position in node-id order).
    pub fn rank_of(&self, node: &NodeId) -> Option<usize> {
        self.members.binary_search(node).ok()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_follow_node_id_order_whatever_the_insertion_order() {
        let view = View::new(Epoch(3), vec!["node-c".into(), "node-a".into(), "node-b".into(), "node-a".into()]);
        assert_eq!(view.len(), 3);
        assert_eq!(view.rank_of(&"node-a".into()), Some(0));
        assert_eq!(view.rank_of(&"node-c".into()), Some(2));
        assert_eq!(view.rank_of(&"node-z".into()), None);
    }
}
