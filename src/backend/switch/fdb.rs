//! The forwarding database: which endpoint each (VLAN, MAC) was last seen on. Each
//! port and uplink learns into its own bounded LRU list, so an endpoint that floods
//! source addresses only ever evicts its own; every operation a frame makes is O(1).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ahash::RandomState;
use std::time::{Duration, Instant};

use super::Endpoint;
use crate::l2::{Domain, Mac};
use crate::stats::DropReason;

/// An address within its broadcast domain: the same MAC may live in several VLANs.
pub type FdbKey = (Domain, Mac);

/// Addresses an uplink (a whole LAN behind it) may have learned at once.
pub const UPLINK_MAC_LIMIT: usize = 8192;

/// How long a learned address that moved stays before it may move again: two
/// endpoints sending from one address make it move at most once per `MOVE_HOLD`.
pub const MOVE_HOLD: Duration = Duration::from_secs(1);

/// Aged entries at the cold end of an endpoint's list that one `learn` reclaims:
/// each entry is removed once, so this keeps `learn` O(1) and the lists clean.
const REAP_PER_LEARN: usize = 4;

/// What learning a frame's source address did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Learned {
    /// Already there (refreshed), pinned there, or a group address (never learned).
    Known,
    /// A new address for the endpoint.
    New,
    /// The address moved here from `from`.
    Moved { from: Endpoint },
    /// The frame may not come from there: a pinned address, or a move too soon.
    Refused(DropReason),
}

const NIL: u32 = u32::MAX;

struct Entry {
    key: FdbKey,
    at: Endpoint,
    seen: Instant,
    /// When it last moved between endpoints (never: it may move at once).
    moved: Option<Instant>,
    /// Neighbours in its endpoint's list (towards the head: more recently seen).
    prev: u32,
    next: u32,
}

/// One endpoint's learned addresses, most recently seen first.
#[derive(Clone, Copy)]
struct Lru {
    head: u32,
    tail: u32,
    len: usize,
    limit: usize,
}

/// MAC learning table with aging, one address space per VLAN, a quota per endpoint.
///
/// Its maps hash with aHash under a key drawn at random per table (`RandomState`):
/// a few ns per lookup where SipHash took tens, and still no address an attacker can
/// choose to collide, since the key is not known outside the process.
pub struct Fdb {
    map: HashMap<FdbKey, u32, RandomState>,
    slab: Vec<Entry>,
    free: Vec<u32>,
    /// One list per endpoint in the table; `index` says whose.
    lists: Vec<Lru>,
    index: HashMap<Endpoint, usize, RandomState>,
    /// Lists of endpoints taken out, for the next one added.
    spare: Vec<usize>,
    /// Addresses the operator configured: never aged, never moved by learning.
    pinned: HashMap<FdbKey, Endpoint, RandomState>,
    aging: Duration,
    /// Changes to what the table answers (an address learnt, moved, forgotten,
    /// pinned; an endpoint added or removed), counted under the table's lock and
    /// read without it: a sender reuses an answer while this has not moved
    /// (`Switch::route`). A refreshed date is not a change.
    changes: Arc<AtomicU64>,
    /// Entries removed so far: every loop over a list removes one per step, so this
    /// counts the work beyond the O(1) map and list updates (tests).
    #[cfg(test)]
    removed: usize,
}

impl Fdb {
    /// A table for ports and uplinks that may learn `port_limits[i]` and
    /// `uplink_limits[i]` addresses each (at least one).
    pub fn new(aging: Duration, port_limits: &[usize], uplink_limits: &[usize]) -> Fdb {
        let mut fdb = Fdb {
            map: HashMap::default(),
            slab: Vec::new(),
            free: Vec::new(),
            lists: Vec::new(),
            index: HashMap::default(),
            spare: Vec::new(),
            pinned: HashMap::default(),
            aging,
            changes: Arc::new(AtomicU64::new(0)),
            #[cfg(test)]
            removed: 0,
        };
        for (i, &limit) in port_limits.iter().enumerate() {
            fdb.add(Endpoint::Port(i), limit);
        }
        for (i, &limit) in uplink_limits.iter().enumerate() {
            fdb.add(Endpoint::Uplink(i), limit);
        }
        fdb
    }

    /// Makes room for endpoint `at`, which may learn `limit` addresses (at least one).
    /// An endpoint not in the table learns nothing.
    pub fn add(&mut self, at: Endpoint, limit: usize) {
        self.changed();
        let lru = Lru {
            head: NIL,
            tail: NIL,
            len: 0,
            limit: limit.max(1),
        };
        if let Some(&l) = self.index.get(&at) {
            self.forget(at);
            self.lists[l] = lru;
            return;
        }
        let l = match self.spare.pop() {
            Some(l) => {
                self.lists[l] = lru;
                l
            }
            None => {
                self.lists.push(lru);
                self.lists.len() - 1
            }
        };
        self.index.insert(at, l);
    }

    /// Takes endpoint `at` out: what it learned goes, in O(its addresses), and it
    /// learns nothing more.
    pub fn remove(&mut self, at: Endpoint) {
        self.changed();
        self.forget(at);
        if let Some(l) = self.index.remove(&at) {
            self.spare.push(l);
        }
    }

    /// Unpins `key` if it is pinned to `at`.
    pub fn unpin(&mut self, key: &FdbKey, at: Endpoint) {
        if self.pinned.get(key) == Some(&at) {
            self.changed();
            self.pinned.remove(key);
        }
    }

    fn list_of(&self, e: Endpoint) -> Option<usize> {
        self.index.get(&e).copied()
    }

    pub fn pin(&mut self, key: FdbKey, at: Endpoint) {
        if let Some(&i) = self.map.get(&key) {
            self.remove_entry(i);
        }
        self.changed();
        self.pinned.insert(key, at);
    }

    /// The counter of changes (see the field), for reading without the lock.
    pub fn changes(&self) -> Arc<AtomicU64> {
        self.changes.clone()
    }

    /// The changes counted so far (under the lock).
    pub fn generation(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }

    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Release);
    }

    fn aged(&self, i: u32, now: Instant) -> bool {
        now.saturating_duration_since(self.slab[i as usize].seen) > self.aging
    }

    /// Takes entry `i` out of its endpoint's list.
    fn unlink(&mut self, i: u32) {
        let (prev, next, at) = {
            let e = &self.slab[i as usize];
            (e.prev, e.next, e.at)
        };
        let Some(l) = self.list_of(at) else { return };
        match prev {
            NIL => self.lists[l].head = next,
            p => self.slab[p as usize].next = next,
        }
        match next {
            NIL => self.lists[l].tail = prev,
            n => self.slab[n as usize].prev = prev,
        }
        self.lists[l].len -= 1;
    }

    /// Puts entry `i` at the head of list `l` (most recently seen).
    fn push_front(&mut self, l: usize, i: u32) {
        let head = self.lists[l].head;
        {
            let e = &mut self.slab[i as usize];
            e.prev = NIL;
            e.next = head;
        }
        match head {
            NIL => self.lists[l].tail = i,
            h => self.slab[h as usize].prev = i,
        }
        self.lists[l].head = i;
        self.lists[l].len += 1;
    }

    fn remove_entry(&mut self, i: u32) {
        self.changed();
        #[cfg(test)]
        {
            self.removed += 1;
        }
        self.unlink(i);
        let key = self.slab[i as usize].key;
        self.map.remove(&key);
        self.free.push(i);
    }

    /// Forgets the least recently seen addresses of list `l` beyond its quota.
    fn evict_over_quota(&mut self, l: usize) {
        while self.lists[l].len > self.lists[l].limit {
            let tail = self.lists[l].tail;
            self.remove_entry(tail);
        }
    }

    /// Learns that `key` sends from `at` (group addresses are never learned). A new
    /// address past `at`'s quota replaces `at`'s own least recently seen one, never
    /// another endpoint's. A learned address moves to `at` unless it moved less than
    /// `MOVE_HOLD` ago; a pinned one never moves.
    pub fn learn(&mut self, key: FdbKey, at: Endpoint, now: Instant) -> Learned {
        if key.1.is_multicast() {
            return Learned::Known;
        }
        let pinned = (!self.pinned.is_empty()).then(|| self.pinned.get(&key).copied());
        if let Some(owner) = pinned.flatten() {
            return if owner == at {
                Learned::Known
            } else {
                Learned::Refused(DropReason::MacPinnedElsewhere)
            };
        }
        let Some(l) = self.list_of(at) else {
            return Learned::Known;
        };
        if let Some(&i) = self.map.get(&key) {
            let e = &self.slab[i as usize];
            if e.at == at {
                // Already the most recent of its list (a stream from one address):
                // the date is all that changes.
                if self.lists[l].head != i {
                    self.unlink(i);
                    self.push_front(l, i);
                }
                self.slab[i as usize].seen = now;
                return Learned::Known;
            }
            if !self.aged(i, now) {
                if e.moved
                    .is_some_and(|m| now.saturating_duration_since(m) < MOVE_HOLD)
                {
                    return Learned::Refused(DropReason::MacMoveRefused);
                }
                let from = e.at;
                self.unlink(i);
                let e = &mut self.slab[i as usize];
                e.at = at;
                e.seen = now;
                e.moved = Some(now);
                self.push_front(l, i);
                self.evict_over_quota(l);
                self.changed();
                return Learned::Moved { from };
            }
            // Forgotten where it was: learnt anew here, not a move.
            self.remove_entry(i);
        }
        for _ in 0..REAP_PER_LEARN {
            match self.lists[l].tail {
                NIL => break,
                t if self.aged(t, now) => self.remove_entry(t),
                _ => break,
            }
        }
        let entry = Entry {
            key,
            at,
            seen: now,
            moved: None,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = entry;
                i
            }
            None => {
                self.slab.push(entry);
                (self.slab.len() - 1) as u32
            }
        };
        self.map.insert(key, i);
        self.push_front(l, i);
        self.evict_over_quota(l);
        self.changed();
        Learned::New
    }

    pub fn lookup(&mut self, key: &FdbKey, now: Instant) -> Option<Endpoint> {
        if !self.pinned.is_empty() {
            if let Some(&e) = self.pinned.get(key) {
                return Some(e);
            }
        }
        let &i = self.map.get(key)?;
        if self.aged(i, now) {
            self.remove_entry(i);
            return None;
        }
        Some(self.slab[i as usize].at)
    }

    /// Forgets everything learned on `at` (its guest went away): O(its addresses).
    pub fn forget(&mut self, at: Endpoint) {
        let Some(l) = self.list_of(at) else { return };
        while self.lists[l].head != NIL {
            let h = self.lists[l].head;
            self.remove_entry(h);
        }
    }

    /// Addresses learned on `at` now (aged ones not yet reclaimed included).
    pub fn learned_on(&self, at: Endpoint) -> usize {
        self.list_of(at).map_or(0, |l| self.lists[l].len)
    }

    /// Addresses learned in all.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// What a sender's last frame asked the table, and when: its source, addresses, the
/// batch's time and the table's changes then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoKey {
    pub src: Endpoint,
    pub domain: Domain,
    pub from: Mac,
    pub to: Mac,
    pub now: Instant,
    pub generation: u64,
}

/// A sender's last answer from the table (the destination known for `MemoKey`, if
/// any), so the next frames of its batch between the same two addresses skip the
/// table's lock and both lookups. Learning the same source again at the same time
/// changes nothing, and any change to the table moves its generation, so the answer
/// is the one the table would give.
#[derive(Clone, Copy, Debug, Default)]
pub struct FdbMemo(Option<(MemoKey, Option<Endpoint>)>);

impl FdbMemo {
    pub fn get(&self, key: &MemoKey) -> Option<Option<Endpoint>> {
        self.0.filter(|(k, _)| k == key).map(|(_, known)| known)
    }

    pub fn set(&mut self, key: MemoKey, known: Option<Endpoint>) {
        self.0 = Some((key, known));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::l2::Vid;

    const P0: Endpoint = Endpoint::Port(0);
    const P1: Endpoint = Endpoint::Port(1);
    const P2: Endpoint = Endpoint::Port(2);
    const U0: Endpoint = Endpoint::Uplink(0);

    fn fdb(aging_secs: u64, port_limit: usize) -> Fdb {
        Fdb::new(
            Duration::from_secs(aging_secs),
            &[port_limit; 4],
            &[UPLINK_MAC_LIMIT],
        )
    }

    fn key(i: usize) -> FdbKey {
        let b = (i as u32).to_be_bytes();
        (None, Mac([2, 0, b[0], b[1], b[2], b[3]]))
    }

    /// The list of `at`, most recently seen first, walked both ways.
    fn order(f: &Fdb, at: Endpoint) -> Vec<FdbKey> {
        let l = f.list_of(at).unwrap();
        let mut fwd = Vec::new();
        let mut i = f.lists[l].head;
        while i != NIL {
            fwd.push(f.slab[i as usize].key);
            i = f.slab[i as usize].next;
        }
        let mut back = Vec::new();
        let mut i = f.lists[l].tail;
        while i != NIL {
            back.push(f.slab[i as usize].key);
            i = f.slab[i as usize].prev;
        }
        back.reverse();
        assert_eq!(fwd, back, "list links disagree");
        assert_eq!(fwd.len(), f.lists[l].len);
        fwd
    }

    #[test]
    fn the_generation_moves_with_every_answer_that_changes_and_not_with_a_refresh() {
        let mut f = fdb(300, 8);
        let t = Instant::now();
        let g = |f: &Fdb| f.generation();
        let g0 = g(&f);
        assert_eq!(f.learn(key(1), P0, t), Learned::New);
        let g1 = g(&f);
        assert!(g1 > g0);
        assert_eq!(
            f.learn(key(1), P0, t + Duration::from_secs(1)),
            Learned::Known
        );
        assert_eq!(f.lookup(&key(1), t), Some(P0));
        assert_eq!(g(&f), g1, "a refresh or a lookup is not a change");
        assert!(matches!(
            f.learn(key(1), P1, t + MOVE_HOLD * 2),
            Learned::Moved { .. }
        ));
        let g2 = g(&f);
        assert!(g2 > g1);
        f.forget(P1);
        let g3 = g(&f);
        assert!(g3 > g2);
        f.pin(key(2), P2);
        assert!(g(&f) > g3);
    }

    #[test]
    fn fdb_learns_ages_and_forgets() {
        let t0 = Instant::now();
        let mut f = fdb(10, 256);
        let a = Mac([2, 0, 0, 0, 0, 1]);
        assert_eq!(f.learn((None, a), P1, t0), Learned::New);
        assert_eq!(f.learn((None, a), P1, t0), Learned::Known);
        assert_eq!(f.lookup(&(None, a), t0 + Duration::from_secs(5)), Some(P1));
        assert_eq!(f.lookup(&(None, a), t0 + Duration::from_secs(11)), None);
        assert!(f.is_empty());
        f.learn((None, a), U0, t0);
        f.forget(U0);
        assert_eq!(f.lookup(&(None, a), t0), None);
        assert_eq!(f.learned_on(U0), 0);
        // An address aged out where it was is learnt anew elsewhere, not moved.
        f.learn((None, a), P1, t0);
        let later = t0 + Duration::from_secs(11);
        assert_eq!(f.learn((None, a), P2, later), Learned::New);
        assert_eq!(f.lookup(&(None, a), later), Some(P2));
        assert_eq!((f.learned_on(P1), f.learned_on(P2)), (0, 1));
    }

    #[test]
    fn pinned_addresses_win_over_learning_and_never_move() {
        let t0 = Instant::now();
        let mut f = fdb(1, 256);
        let a = Mac([2, 0, 0, 0, 0, 9]);
        f.learn((None, a), P1, t0);
        f.pin((None, a), Endpoint::Port(3));
        assert_eq!(f.learned_on(P1), 0, "pinning drops the learned entry");
        assert_eq!(
            f.learn((None, a), U0, t0),
            Learned::Refused(DropReason::MacPinnedElsewhere)
        );
        assert_eq!(f.learn((None, a), Endpoint::Port(3), t0), Learned::Known);
        assert_eq!(
            f.lookup(&(None, a), t0 + Duration::from_secs(100)),
            Some(Endpoint::Port(3))
        );
        // Pinned in its VLAN only.
        let v = Vid::new(5);
        assert_eq!(f.learn((v, a), U0, t0), Learned::New);
    }

    #[test]
    fn a_port_over_its_quota_evicts_its_own_oldest() {
        let t0 = Instant::now();
        let mut f = fdb(300, 4);
        // P0 knows two addresses; the uplink one.
        f.learn(key(101000), P0, t0);
        f.learn(key(101001), P0, t0);
        f.learn(key(102000), U0, t0);
        // P1 floods 10,000 addresses: it keeps its 4 newest, nobody else loses any.
        for i in 0..10_000 {
            assert_eq!(f.learn(key(i), P1, t0), Learned::New);
        }
        assert_eq!(f.learned_on(P1), 4);
        assert_eq!(
            order(&f, P1),
            vec![key(9999), key(9998), key(9997), key(9996)]
        );
        assert_eq!(f.lookup(&key(101000), t0), Some(P0));
        assert_eq!(f.lookup(&key(101001), t0), Some(P0));
        assert_eq!(f.lookup(&key(102000), t0), Some(U0));
        assert_eq!(f.lookup(&key(5), t0), None);
        assert_eq!(f.len(), 7);
        // Freed entries are reused: the table never grew past what quotas allow.
        assert!(f.slab.len() <= 4 + 4 + 1 + 1, "{} entries", f.slab.len());
        // A new host on P0 is learned at once, past P1's flood.
        assert_eq!(f.learn(key(101002), P0, t0), Learned::New);
        assert_eq!(f.lookup(&key(101002), t0), Some(P0));
    }

    #[test]
    fn the_least_recently_seen_goes_first() {
        let t0 = Instant::now();
        let mut f = fdb(300, 3);
        for i in 0..3 {
            f.learn(key(i), P0, t0);
        }
        // 0 speaks again: 1 is now the oldest and goes when 3 arrives.
        f.learn(key(0), P0, t0);
        assert_eq!(order(&f, P0), vec![key(0), key(2), key(1)]);
        f.learn(key(3), P0, t0);
        assert_eq!(order(&f, P0), vec![key(3), key(0), key(2)]);
        assert_eq!(f.lookup(&key(1), t0), None);
    }

    #[test]
    fn moves_are_counted_held_and_charged_to_the_new_place() {
        let t0 = Instant::now();
        let mut f = fdb(300, 2);
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        f.learn(key(1), P0, s(0));
        f.learn(key(7), P1, s(0));
        f.learn(key(8), P1, s(0));
        // The first move is allowed at once; the address now counts against P1's
        // quota, which evicts P1's oldest (7), not anything of P0's.
        assert_eq!(f.learn(key(1), P1, s(10)), Learned::Moved { from: P0 });
        assert_eq!(f.lookup(&key(1), s(10)), Some(P1));
        assert_eq!((f.learned_on(P0), f.learned_on(P1)), (0, 2));
        assert_eq!(f.lookup(&key(7), s(10)), None);
        // Moving on within MOVE_HOLD is refused, from anywhere; its current place
        // keeps it fresh meanwhile.
        for (at, ms) in [(P0, 20), (P2, 500), (P1, 900), (U0, 1009)] {
            let want = if at == P1 {
                Learned::Known
            } else {
                Learned::Refused(DropReason::MacMoveRefused)
            };
            assert_eq!(f.learn(key(1), at, s(ms)), want, "{at:?} at {ms} ms");
        }
        assert_eq!(f.lookup(&key(1), s(1009)), Some(P1));
        // After the hold it moves again.
        assert_eq!(f.learn(key(1), P0, s(1011)), Learned::Moved { from: P1 });
        assert_eq!(f.lookup(&key(1), s(1011)), Some(P0));
        // Two endpoints fighting over it for 10 s: at most one move a second.
        let mut moves = 0;
        for ms in (1020..11_020).step_by(5) {
            for at in [P1, P0] {
                if let Learned::Moved { .. } = f.learn(key(1), at, s(ms)) {
                    moves += 1;
                }
            }
        }
        assert!((9..=10).contains(&moves), "{moves} moves in 10 s");
    }

    #[test]
    fn aged_entries_are_reclaimed_a_few_at_a_time() {
        let t0 = Instant::now();
        let mut f = fdb(10, 100);
        for i in 0..100 {
            f.learn(key(i), P0, t0);
        }
        let later = t0 + Duration::from_secs(11);
        f.learn(key(500), P0, later);
        assert_eq!(f.learned_on(P0), 101 - REAP_PER_LEARN);
        // Every lookup of an aged address forgets it, too.
        assert_eq!(f.lookup(&key(50), later), None);
        assert_eq!(f.learned_on(P0), 100 - REAP_PER_LEARN);
        for i in 0..100 {
            f.learn(key(1000 + i), P0, later);
        }
        assert_eq!(f.learned_on(P0), 100);
        assert!(order(&f, P0).iter().all(|k| f.lookup(k, later).is_some()));
    }

    /// The work per learned address does not grow with the table: a flood into a full
    /// table removes exactly one entry per new address (its endpoint's least recently
    /// seen), one into an empty table none. Counted, not timed: the loops of `learn`
    /// step only by removing an entry, so a scan would show as removals.
    #[test]
    fn learning_into_a_full_table_stays_constant_time() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(300), &[65536, 65536], &[]);
        let work = |f: &mut Fdb, from: usize, at: Endpoint| {
            let before = f.removed;
            for i in from..from + 20_000 {
                assert_eq!(f.learn(key(i), at, t0), Learned::New);
            }
            f.removed - before
        };
        assert_eq!(work(&mut f, 0, P1), 0);
        for i in 0..65536 {
            f.learn(key(1_000_000 + i), P0, t0);
        }
        // P0 full: every new address evicts one, P0's oldest, and nothing else.
        assert_eq!(work(&mut f, 2_000_000, P0), 20_000);
        assert_eq!(f.learned_on(P0), 65536);
        assert_eq!(f.learned_on(P1), 20_000);
        assert!(f.lookup(&key(1_000_000 + 19_999), t0).is_none());
        assert_eq!(f.lookup(&key(1_000_000 + 20_000), t0), Some(P0));
    }

    #[test]
    fn multicast_sources_are_not_learned() {
        let t0 = Instant::now();
        let mut f = fdb(10, 256);
        let m = Mac([1, 0, 0x5e, 0, 0, 1]);
        assert_eq!(f.learn((None, m), P0, t0), Learned::Known);
        assert_eq!(f.lookup(&(None, m), t0), None);
    }

    #[test]
    fn unknown_endpoints_learn_nothing() {
        let t0 = Instant::now();
        let mut f = fdb(10, 256);
        assert_eq!(f.learn(key(1), Endpoint::Port(9), t0), Learned::Known);
        assert_eq!(f.learn(key(1), Endpoint::Uplink(3), t0), Learned::Known);
        assert!(f.is_empty());
        f.forget(Endpoint::Port(9));
    }

    #[test]
    fn same_mac_in_two_vlans_is_two_addresses() {
        let t0 = Instant::now();
        let mut f = fdb(10, 256);
        let a = Mac([2, 0, 0, 0, 0, 1]);
        let (v10, v20) = (Vid::new(10), Vid::new(20));
        f.learn((v10, a), P0, t0);
        assert_eq!(f.learn((v20, a), U0, t0), Learned::New);
        assert_eq!(f.lookup(&(v10, a), t0), Some(P0));
        assert_eq!(f.lookup(&(v20, a), t0), Some(U0));
        assert_eq!(f.lookup(&(None, a), t0), None);
    }
}
