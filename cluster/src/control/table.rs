//! Which connection is current for each peer name. Each inserted connection gets an id, so that the
//! end of a replaced connection can be told from the end of the current one.

use std::collections::HashMap;

#[derive(Debug)]
pub(super) struct PeerTable<L> {
    entries: HashMap<String, (u64, L)>,
    next_id: u64,
}

impl<L> Default for PeerTable<L> {
    fn default() -> Self {
        PeerTable { entries: HashMap::new(), next_id: 0 }
    }
}

impl<L: Clone> PeerTable<L> {
    /// The id the next inserted connection gets.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }

    /// Makes `link` the current connection to `name`; returns its id and the one it replaces.
    pub fn insert(&mut self, name: &str, link: L) -> (u64, Option<L>) {
        let id = self.next_id;
        self.next_id += 1;
        let old = self.entries.insert(name.to_string(), (id, link));
        (id, old.map(|(_, l)| l))
    }

    pub fn get(&self, name: &str) -> Option<L> {
        self.entries.get(name).map(|(_, l)| l.clone())
    }

    pub fn is_current(&self, name: &str, id: u64) -> bool {
        self.entries.get(name).is_some_and(|(current, _)| *current == id)
    }

    /// Removes connection `id` of `name` if it is still the current one.
    pub fn remove_if_current(&mut self, name: &str, id: u64) -> Option<L> {
        if !self.is_current(name, id) {
            return None;
        }
        self.entries.remove(name).map(|(_, l)| l)
    }

    pub fn remove(&mut self, name: &str) -> Option<L> {
        self.entries.remove(name).map(|(_, l)| l)
    }

    pub fn drain(&mut self) -> Vec<L> {
        self.entries.drain().map(|(_, (_, l))| l).collect()
    }

    /// Every peer with its current connection, sorted by name.
    pub fn list(&self) -> Vec<(String, L)> {
        let mut all: Vec<(String, L)> = self.entries.iter().map(|(n, (_, l))| (n.clone(), l.clone())).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_connection_is_not_current() {
        let mut t = PeerTable::default();
        let (old, none) = t.insert("node-b", "first");
        assert_eq!(none, None);
        let (new, replaced) = t.insert("node-b", "second");
        assert_eq!(replaced, Some("first"));
        assert!(!t.is_current("node-b", old) && t.is_current("node-b", new));
        assert_eq!(t.remove_if_current("node-b", old), None, "the old connection's end removes nothing");
        assert_eq!(t.get("node-b"), Some("second"));
        assert_eq!(t.remove_if_current("node-b", new), Some("second"));
        assert_eq!(t.get("node-b"), None);
    }

    #[test]
    fn lists_sorted_and_drains() {
        let mut t = PeerTable::default();
        t.insert("node-c", 3);
        t.insert("node-a", 1);
        assert_eq!(t.list(), vec![("node-a".to_string(), 1), ("node-c".to_string(), 3)]);
        assert_eq!(t.remove("node-a"), Some(1));
        assert_eq!(t.drain(), vec![3]);
        assert!(t.list().is_empty());
    }
}
