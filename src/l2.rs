//! Ethernet basics every room shares: MAC addresses, 802.1Q VLAN ids, ethertypes and
//! reading a frame's tag. A leaf: it imports nothing from the rest of gsonet.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Bytes of an Ethernet header without tags: destination, source, ethertype.
pub const ETH_HDR_LEN: usize = 14;
/// Destination and source MAC: what stays in front of a tag.
pub const ADDRS_LEN: usize = 12;
/// Bytes of one 802.1Q / 802.1ad tag (TPID and TCI).
pub const TAG_LEN: usize = 4;

pub const ETHERTYPE_IPV4: u16 = 0x0800;
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
/// 802.1Q (the tag gsonet adds and removes).
pub const ETHERTYPE_VLAN: u16 = 0x8100;
/// 802.1ad service tag.
pub const ETHERTYPE_QINQ: u16 = 0x88a8;
/// Pre-standard QinQ.
pub const ETHERTYPE_QINQ_OLD: u16 = 0x9100;

/// Whether an ethertype says a VLAN tag follows (802.1Q, 802.1ad, pre-standard QinQ).
pub fn is_tag_type(ethertype: u16) -> bool {
    matches!(
        ethertype,
        ETHERTYPE_VLAN | ETHERTYPE_QINQ | ETHERTYPE_QINQ_OLD
    )
}

/// A MAC address, written `52:54:00:12:34:56`.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    pub const BROADCAST: Mac = Mac([0xff; 6]);

    /// Group address (multicast or broadcast): the I/G bit of the first byte.
    pub fn is_multicast(&self) -> bool {
        self.0[0] & 1 != 0
    }

    /// The destination and source addresses at the front of a frame.
    pub fn pair(addrs: &[u8; ADDRS_LEN]) -> (Mac, Mac) {
        let mut dst = [0u8; 6];
        let mut src = [0u8; 6];
        dst.copy_from_slice(&addrs[..6]);
        src.copy_from_slice(&addrs[6..]);
        (Mac(dst), Mac(src))
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl std::str::FromStr for Mac {
    type Err = String;
    /// Parses a unicast address (a port's own MAC cannot be a group address).
    fn from_str(s: &str) -> Result<Self, String> {
        const WANT: &str = "expected six hex bytes like 52:54:00:12:34:56";
        let bytes: Vec<u8> = s
            .split(':')
            .map(|p| {
                if p.len() == 2 {
                    u8::from_str_radix(p, 16).ok()
                } else {
                    None
                }
            })
            .collect::<Option<_>>()
            .ok_or(WANT)?;
        let mac = Mac(bytes.try_into().map_err(|_| WANT)?);
        if mac.is_multicast() {
            return Err("a multicast address cannot be a port's MAC".into());
        }
        Ok(mac)
    }
}

/// A VLAN id an access port can belong to (1..=4094; 0 and 4095 are reserved).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u16", into = "u16")]
pub struct Vid(u16);

impl Vid {
    pub const MIN: u16 = 1;
    pub const MAX: u16 = 4094;

    pub fn new(v: u16) -> Option<Vid> {
        (Self::MIN..=Self::MAX).contains(&v).then_some(Vid(v))
    }

    pub fn get(self) -> u16 {
        self.0
    }
}

impl TryFrom<u16> for Vid {
    type Error = String;
    fn try_from(v: u16) -> Result<Vid, String> {
        Vid::new(v).ok_or_else(|| format!("VLAN id {v} outside {}..{}", Vid::MIN, Vid::MAX))
    }
}

impl From<Vid> for u16 {
    fn from(v: Vid) -> u16 {
        v.0
    }
}

impl fmt::Display for Vid {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A set of VLAN ids, one bit each: a trunk port's allowed VLANs. Written as a
/// `:`-separated list of ids and ranges, `10-20:30` (commas separate port options).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct VlanSet([u64; 64]);

impl Default for VlanSet {
    fn default() -> VlanSet {
        VlanSet([0; 64])
    }
}

impl VlanSet {
    pub fn insert(&mut self, v: Vid) {
        self.0[usize::from(v.0 / 64)] |= 1 << (v.0 % 64);
    }

    /// Whether the 12-bit VLAN id `vid` of a tag is in the set (0 and 4095 never are).
    pub fn contains(&self, vid: u16) -> bool {
        Vid::new(vid).is_some_and(|v| self.0[usize::from(v.0 / 64)] & (1 << (v.0 % 64)) != 0)
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }

    /// The ids in the set, ascending.
    pub fn iter(&self) -> impl Iterator<Item = Vid> + '_ {
        (Vid::MIN..=Vid::MAX).filter(|&v| self.contains(v)).map(Vid)
    }
}

impl std::str::FromStr for VlanSet {
    type Err = String;
    /// Parses `10`, `10-20`, `10-20:30:40-41` (each id 1..4094, ranges ascending).
    fn from_str(s: &str) -> Result<VlanSet, String> {
        let id = |t: &str| -> Result<Vid, String> {
            t.trim()
                .parse::<u16>()
                .ok()
                .and_then(Vid::new)
                .ok_or_else(|| {
                    format!(
                        "{t:?} is not a VLAN id {}..{} (a list looks like 10-20:30)",
                        Vid::MIN,
                        Vid::MAX
                    )
                })
        };
        let mut set = VlanSet::default();
        for item in s.split(':') {
            let (lo, hi) = match item.split_once('-') {
                Some((a, b)) => (id(a)?, id(b)?),
                None => (id(item)?, id(item)?),
            };
            if lo > hi {
                return Err(format!("range {item:?} runs backwards"));
            }
            for v in lo.0..=hi.0 {
                set.insert(Vid(v));
            }
        }
        Ok(set)
    }
}

impl fmt::Display for VlanSet {
    /// The shortest list: runs of ids as ranges.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let mut first = true;
        let mut run: Option<(u16, u16)> = None;
        let mut out = |f: &mut fmt::Formatter, (lo, hi): (u16, u16)| {
            let sep = if first { "" } else { ":" };
            first = false;
            if lo == hi {
                write!(f, "{sep}{lo}")
            } else {
                write!(f, "{sep}{lo}-{hi}")
            }
        };
        for v in self.iter().map(Vid::get) {
            run = match run {
                Some((lo, hi)) if hi + 1 == v => Some((lo, v)),
                Some(r) => {
                    out(f, r)?;
                    Some((v, v))
                }
                None => Some((v, v)),
            };
        }
        if let Some(r) = run {
            out(f, r)?;
        }
        Ok(())
    }
}

impl fmt::Debug for VlanSet {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "VlanSet({self})")
    }
}

/// The broadcast domain of a frame: an access VLAN, or (`None`) the untagged domain.
pub type Domain = Option<Vid>;

/// What follows a frame's MAC addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    /// Shorter than an Ethernet header.
    Short,
    Untagged,
    /// An 802.1Q tag with this 12-bit VLAN id (0: priority tag only).
    Dot1q(u16),
    /// Another tag type (802.1ad, 0x9100), or an 802.1Q tag cut short.
    Other,
}

impl Tag {
    /// Reads the tag from the first bytes of a frame (`head`, at most the frame).
    pub fn read(head: &[u8]) -> Tag {
        if head.len() < ETH_HDR_LEN {
            return Tag::Short;
        }
        let ethertype = u16::from_be_bytes([head[12], head[13]]);
        if !is_tag_type(ethertype) {
            Tag::Untagged
        } else if ethertype == ETHERTYPE_VLAN && head.len() >= ADDRS_LEN + TAG_LEN {
            Tag::Dot1q(u16::from_be_bytes([head[14], head[15]]) & 0x0fff)
        } else {
            Tag::Other
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::frames::ethernet_len;

    #[test]
    fn vid_range() {
        assert!(Vid::new(0).is_none() && Vid::new(4095).is_none());
        assert_eq!(Vid::new(1).map(Vid::get), Some(1));
        assert_eq!(Vid::new(4094).map(Vid::get), Some(4094));
    }

    #[test]
    fn mac_text_and_group_bit() {
        let m: Mac = "52:54:00:00:00:01".parse().unwrap();
        assert_eq!(m.to_string(), "52:54:00:00:00:01");
        assert!(!m.is_multicast() && Mac::BROADCAST.is_multicast());
        assert!("01:00:5e:00:00:01".parse::<Mac>().is_err());
        assert!("zz".parse::<Mac>().is_err());
        assert!("52:54:00:00:00".parse::<Mac>().is_err());
    }

    #[test]
    fn vlan_set_text() {
        let s: VlanSet = "10-20:30:4094".parse().unwrap();
        assert!(s.contains(10) && s.contains(15) && s.contains(20) && s.contains(30));
        assert!(!s.contains(9) && !s.contains(21) && !s.contains(0) && !s.contains(4095));
        assert!(s.contains(4094));
        assert_eq!(s.iter().count(), 13);
        assert_eq!(s.to_string(), "10-20:30:4094");
        assert_eq!("5:3:4:1".parse::<VlanSet>().unwrap().to_string(), "1:3-5");
        for bad in ["", "0", "4095", "20-10", "a", "1,2", "1-", ":", "10:"] {
            assert!(bad.parse::<VlanSet>().is_err(), "{bad:?}");
        }
        assert!(VlanSet::default().is_empty() && !s.is_empty());
    }

    #[test]
    fn reads_tags() {
        let t = ethernet_len(&[(ETHERTYPE_VLAN, 0x600a)], 0x0800, 40); // PCP 3, VID 10
        assert_eq!(Tag::read(&t), Tag::Dot1q(10));
        assert_eq!(Tag::read(&ethernet_len(&[], 0x0800, 60)), Tag::Untagged);
        assert_eq!(
            Tag::read(&ethernet_len(&[], ETHERTYPE_QINQ, 60)),
            Tag::Other
        );
        assert_eq!(
            Tag::read(&ethernet_len(&[], ETHERTYPE_VLAN, 15)),
            Tag::Other
        );
        assert_eq!(Tag::read(&ethernet_len(&[], 0x0800, 60)[..13]), Tag::Short);
        assert_eq!(Tag::read(&[]), Tag::Short);
    }
}
