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
