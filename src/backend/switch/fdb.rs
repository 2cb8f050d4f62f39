//! The forwarding database: which endpoint each (VLAN, MAC) was last seen on, with
//! aging, operator-pinned addresses, and a bound on its size.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::Endpoint;
use crate::l2::{Domain, Mac};

/// An address within its broadcast domain: the same MAC may live in several VLANs.
pub type FdbKey = (Domain, Mac);

/// Most addresses the learning table holds.
pub const FDB_MAX: usize = 8192;

/// MAC learning table with aging, one address space per VLAN.
pub struct Fdb {
    entries: HashMap<FdbKey, (Endpoint, Instant)>,
    /// Addresses the operator configured: never aged, never moved by learning.
    pinned: HashMap<FdbKey, Endpoint>,
    aging: Duration,
}

impl Fdb {
    pub fn new(aging: Duration) -> Fdb {
        Fdb {
            entries: HashMap::new(),
            pinned: HashMap::new(),
            aging,
        }
    }

    pub fn pin(&mut self, key: FdbKey, at: Endpoint) {
        self.pinned.insert(key, at);
    }

    /// Learns `key` at `at` (multicast sources are never learned). The table holds at
    /// most `FDB_MAX` addresses, so a guest sending from random source addresses
    /// cannot grow it without bound: when full, aged entries go first, and if none
    /// have aged, new addresses are not learned (frames to them are flooded).
    pub fn learn(&mut self, key: FdbKey, at: Endpoint, now: Instant) {
        if key.1.is_multicast() || self.pinned.contains_key(&key) {
            return;
        }
        if self.entries.len() >= FDB_MAX && !self.entries.contains_key(&key) {
            let aging = self.aging;
            self.entries
                .retain(|_, (_, seen)| now.duration_since(*seen) <= aging);
            if self.entries.len() >= FDB_MAX {
                return;
            }
        }
        self.entries.insert(key, (at, now));
    }

    pub fn lookup(&mut self, key: &FdbKey, now: Instant) -> Option<Endpoint> {
        if let Some(&e) = self.pinned.get(key) {
            return Some(e);
        }
        match self.entries.get(key) {
            Some(&(e, seen)) if now.duration_since(seen) <= self.aging => Some(e),
            Some(_) => {
                self.entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// Forgets everything learned on `at` (its guest went away).
    pub fn forget(&mut self, at: Endpoint) {
        self.entries.retain(|_, (e, _)| *e != at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::l2::Vid;

    #[test]
    fn fdb_learns_ages_and_forgets() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let a = Mac([2, 0, 0, 0, 0, 1]);
        f.learn((None, a), Endpoint::Port(1), t0);
        assert_eq!(
            f.lookup(&(None, a), t0 + Duration::from_secs(5)),
            Some(Endpoint::Port(1))
        );
        assert_eq!(f.lookup(&(None, a), t0 + Duration::from_secs(11)), None);
        f.learn((None, a), Endpoint::Uplink(0), t0);
        f.forget(Endpoint::Uplink(0));
        assert_eq!(f.lookup(&(None, a), t0), None);
        // Moves follow the latest source.
        f.learn((None, a), Endpoint::Port(1), t0);
        f.learn((None, a), Endpoint::Port(2), t0);
        assert_eq!(f.lookup(&(None, a), t0), Some(Endpoint::Port(2)));
    }

    #[test]
    fn pinned_addresses_win_over_learning() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(1));
        let a = Mac([2, 0, 0, 0, 0, 9]);
        f.pin((None, a), Endpoint::Port(3));
        f.learn((None, a), Endpoint::Uplink(0), t0);
        assert_eq!(
            f.lookup(&(None, a), t0 + Duration::from_secs(100)),
            Some(Endpoint::Port(3))
        );
    }

    #[test]
    fn table_is_bounded_and_makes_room_from_aged_entries() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let key = |i: usize| -> FdbKey {
            let b = (i as u32).to_be_bytes();
            (None, Mac([2, 0, b[0], b[1], b[2], b[3]]))
        };
        for i in 0..FDB_MAX + 100 {
            f.learn(key(i), Endpoint::Port(1), t0);
        }
        assert_eq!(f.entries.len(), FDB_MAX);
        assert_eq!(
            f.lookup(&key(FDB_MAX + 50), t0),
            None,
            "learned past the limit"
        );
        assert_eq!(f.lookup(&key(5), t0), Some(Endpoint::Port(1)));
        // Known addresses still move; once entries age, new ones are learned again.
        f.learn(key(5), Endpoint::Port(2), t0);
        assert_eq!(f.lookup(&key(5), t0), Some(Endpoint::Port(2)));
        let later = t0 + Duration::from_secs(11);
        f.learn(key(FDB_MAX + 50), Endpoint::Port(3), later);
        assert_eq!(f.lookup(&key(FDB_MAX + 50), later), Some(Endpoint::Port(3)));
    }

    #[test]
    fn multicast_sources_are_not_learned() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let m = Mac([1, 0, 0x5e, 0, 0, 1]);
        f.learn((None, m), Endpoint::Port(0), t0);
        assert_eq!(f.lookup(&(None, m), t0), None);
    }

    #[test]
    fn same_mac_in_two_vlans_is_two_addresses() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let a = Mac([2, 0, 0, 0, 0, 1]);
        let (v10, v20) = (Vid::new(10), Vid::new(20));
        f.learn((v10, a), Endpoint::Port(0), t0);
        f.learn((v20, a), Endpoint::Uplink(0), t0);
        assert_eq!(f.lookup(&(v10, a), t0), Some(Endpoint::Port(0)));
        assert_eq!(f.lookup(&(v20, a), t0), Some(Endpoint::Uplink(0)));
        assert_eq!(f.lookup(&(None, a), t0), None);
    }
}
