//! Configuration: ports and uplinks, from `--port`/`--uplink` strings
//! (`key=value,...`) or from a TOML file whose tables use the same keys.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::features::FeatureMask;
use crate::l2::{Mac, Vid, VlanSet};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{what}: unknown key {key:?} (known: {known})")]
    UnknownKey {
        what: &'static str,
        key: String,
        known: String,
    },
    #[error("{what}: {key}={value:?} is not valid: {why}")]
    BadValue {
        what: &'static str,
        key: String,
        value: String,
        why: String,
    },
    #[error("{what}: missing {key}=")]
    Missing {
        what: &'static str,
        key: &'static str,
    },
    #[error("cannot read config file {path}: {err}")]
    File { path: String, err: String },
    #[error("config file {path}: {err}")]
    Toml { path: String, err: String },
    #[error("two ports use the same socket {0}")]
    DuplicateSocket(String),
    #[error("no --port or --xen-vif given: gsonet needs at least one port")]
    NoPorts,
}

/// How an uplink handles GSO frames it cannot be trusted to take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GsoMode {
    /// Hand GSO frames to the device intact (it or the kernel segments).
    Pass,
    /// Segment in gsonet, just before the device.
    Software,
}

impl std::str::FromStr for GsoMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "pass" => Ok(GsoMode::Pass),
            "software" => Ok(GsoMode::Software),
            _ => Err("expected pass or software".into()),
        }
    }
}

/// A group named in `socket_group=`/`--control-group`: a name, looked up when the
/// socket is created, or a numeric gid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupSpec {
    Id(u32),
    Name(String),
}

impl fmt::Display for GroupSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupSpec::Id(g) => write!(f, "{g}"),
            GroupSpec::Name(n) => f.write_str(n),
        }
    }
}

/// Who may connect to a socket gsonet listens on: its mode bits and its group (unset:
/// the group gsonet runs as).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketAccess {
    pub mode: u32,
    pub group: Option<GroupSpec>,
}

impl SocketAccess {
    /// A port's socket: owner and group may connect.
    pub const PORT_MODE: u32 = 0o660;
    /// The control socket: the owner only.
    pub const CONTROL_MODE: u32 = 0o600;
}

/// A socket mode in octal (`0660`, `660` or `0o660`): permission bits only, at most 0777.
pub fn parse_mode(v: &str) -> Result<u32, String> {
    let digits = v.strip_prefix("0o").unwrap_or(v);
    let why =
        "expected an octal mode such as 0660 (at most 0777; in TOML a string \"0660\" or 0o660)";
    if digits.is_empty() || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return Err(why.into());
    }
    u32::from_str_radix(digits, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| why.into())
}

/// A group: a numeric gid or a group name (looked up when the socket is created).
pub fn parse_group(v: &str) -> Result<GroupSpec, String> {
    if v.is_empty() {
        return Err("expected a group name or a gid".into());
    }
    if v.bytes().all(|b| b.is_ascii_digit()) {
        return v
            .parse::<u32>()
            .ok()
            .filter(|g| *g != u32::MAX)
            .map(GroupSpec::Id)
            .ok_or_else(|| "gid out of range".into());
    }
    if v.contains(['/', ':', '\0']) || v.chars().any(char::is_whitespace) {
        return Err("not a group name".into());
    }
    Ok(GroupSpec::Name(v.to_string()))
}

/// One vhost-user port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortConfig {
    pub socket: PathBuf,
    /// Connect to QEMU's socket (QEMU `server=on`) instead of listening.
    pub client: bool,
    pub queues: u16,
    pub mac: Option<Mac>,
    /// MTU reported to the guest and used to size software segments.
    pub mtu: u16,
    /// Largest L3 packet this port receives (FreeBSD's max_burst); below the MTU.
    pub max_burst: Option<usize>,
    pub mask: FeatureMask,
    /// Access VLAN: the guest sees VLAN `vlan` untagged; uplinks see it tagged.
    /// `None`: the untagged domain.
    pub vlan: Option<Vid>,
    /// `trunk=on`: the guest sends and receives these VLANs tagged (and the untagged
    /// domain untagged). `None`: an access or untagged port, which sends untagged
    /// frames only.
    pub trunk: Option<VlanSet>,
    /// Port security: the guest may send only from `mac` (needs `mac`).
    pub mac_lock: bool,
    /// GRO: coalesce TCP segments into GSO frames for a guest that accepts TSO.
    pub gro: bool,
    /// `rate=MBIT[,burst=KB]`: what the guest may send, in bytes on the wire.
    pub rate: Option<RateLimit>,
    /// `rx_rate=MBIT[,rx_burst=KB]`: what the guest may receive.
    pub rx_rate: Option<RateLimit>,
    /// Most addresses the switch learns on this port; past it, the port's own oldest
    /// address is forgotten.
    pub mac_limit: usize,
    /// Map guest memory from files not sealed against shrinking (hugetlbfs or
    /// /dev/shm files, DPDK's memfds): the frontend is trusted not to truncate them.
    pub allow_unsealed_memory: bool,
    /// Mode and group of the socket gsonet listens on (not used in client mode).
    pub access: SocketAccess,
    /// After a TX batch, keep the guest's kicks off and look at its TX queue again
    /// this many microseconds later, for as long as each look finds frames (0: off).
    pub tx_poll_us: u32,
    /// Adaptive busy polling: after a TX batch that found frames, spin on the TX queue
    /// (kicks off, yielding the CPU to anything runnable) for up to this many µs
    /// before going back to sleep on its kick (0: off).
    pub busy_poll_us: u32,
    /// Frames of 512 bytes or more go from this guest to another guest with one
    /// copy, straight from its TX buffers into the receiver's RX buffers.
    pub one_copy: bool,
    /// Whether VIRTIO_F_RING_PACKED is offered: a frontend that acks it gets packed
    /// rings.
    pub packed: PackedMode,
    /// Offer VIRTIO_F_IN_ORDER: buffers are used in the order they were made
    /// available (gsonet always does), and a frontend that acks it may read a packed
    /// TX ring's completions in batches.
    pub in_order: bool,
    /// RX interrupt moderation (`ethtool -C rx-usecs rx-frames`): a frame is announced
    /// to the guest at most this many µs after it was written (0: at once) ...
    pub rx_coalesce_usecs: u32,
    /// ... or at once when this many frames wait (0: no count; needs usecs).
    pub rx_coalesce_frames: u32,
    /// TX completion moderation (`ethtool -C tx-usecs`): the call for TX chains the
    /// guest asked to hear about goes out at most this many µs after they were used
    /// (0: at once), so its own RX processing may reclaim them first.
    pub tx_coalesce_usecs: u32,
}

/// Largest `tx_poll_us`: what a frame may wait in a polled queue at most.
pub const MAX_TX_POLL_US: u32 = 1000;
/// Largest `busy_poll_us`: the CPU one idle spell of a port's queue may cost.
pub const MAX_BUSY_POLL_US: u32 = 1000;
/// Default `busy_poll_us`: off. On a host whose guests need every CPU (TCG guests
/// here) the watch takes CPU from them; it is for fast guests with CPUs to spare.
pub const DEFAULT_BUSY_POLL_US: u32 = 0;
/// Largest `rx_coalesce_usecs` and `rx_coalesce_frames`.
pub const MAX_RX_COALESCE_USECS: u32 = 10_000;
pub const MAX_RX_COALESCE_FRAMES: u32 = 1024;
/// Largest `tx_coalesce_usecs`.
pub const MAX_TX_COALESCE_USECS: u32 = 10_000;
/// A byte rate on what an endpoint sends: megabits (10^6) a second on the wire, and
/// how much an idle sender saves up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    pub mbit: u64,
    pub burst_kb: u64,
}

/// Largest `rate=` (Mbit/s) and `burst=` (KiB).
pub const RATE_MBIT_MAX: u64 = 1_000_000;
pub const BURST_KB_MAX: u64 = 1 << 20;
/// `burst=` unless given: two 64 KiB GSO frames.
pub const BURST_KB_DEFAULT: u64 = 128;

/// A `rate` value: 1..1000000 (Mbit/s), or `off`.
pub fn parse_rate(v: &str) -> Result<Option<u64>, String> {
    match v {
        "off" | "none" | "0" => Ok(None),
        _ => match v.parse::<u64>() {
            Ok(n) if (1..=RATE_MBIT_MAX).contains(&n) => Ok(Some(n)),
            _ => Err(format!("must be 1..{RATE_MBIT_MAX} (Mbit/s) or off")),
        },
    }
}

impl RateLimit {
    /// `rate` and `burst` as given; a burst without a rate is an error.
    pub fn with_burst(rate: Option<u64>, burst: Option<u64>) -> Result<Option<RateLimit>, String> {
        match (rate, burst) {
            (None, Some(_)) => Err("burst= needs rate=".into()),
            (None, None) => Ok(None),
            (Some(mbit), b) => Ok(Some(RateLimit {
                mbit,
                burst_kb: b.unwrap_or(BURST_KB_DEFAULT),
            })),
        }
    }
}

/// Addresses a port may have learned at once, unless `mac_limit=` says otherwise.
pub const PORT_MAC_LIMIT: usize = 256;
/// Smallest and largest `mac_limit`.
pub const MAC_LIMIT_RANGE: (usize, usize) = (1, 65536);

impl PortConfig {
    pub fn name(&self) -> String {
        self.socket.display().to_string()
    }
}

/// What an uplink attaches to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UplinkKind {
    /// A tap device gsonet creates (or attaches to).
    Tap(String),
    /// An existing interface, through an AF_PACKET socket; `bypass`: PACKET_QDISC_BYPASS.
    Dev { name: String, bypass: bool },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UplinkConfig {
    pub kind: UplinkKind,
    /// Queues (tap queues or packet sockets); unset: as many as the port (or Xen
    /// vif) with the most queue pairs, so each pair has its own.
    pub queues: Option<u16>,
    pub gso: GsoMode,
    pub max_burst: Option<usize>,
    /// `rate=MBIT[,burst=KB]`: what the uplink may send into gsonet; the rest is
    /// dropped at the tail (`rate_limited`).
    pub rate: Option<RateLimit>,
    /// `rx_rate=MBIT[,rx_burst=KB]`: what gsonet may send into the uplink; a guest
    /// sending over it is held, a frame from another uplink dropped.
    pub rx_rate: Option<RateLimit>,
    /// `mac=` (tap only): the tap's address; unset, one derived from its name.
    pub mac: Option<Mac>,
    /// `persist=on|off` (tap only, default on): the tap outlives gsonet.
    pub persist: bool,
}

pub const MAX_QUEUE_PAIRS: u16 = 16;

fn pairs(s: &str) -> Vec<(String, String)> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.trim().to_string(), v.trim().to_string()),
            None => (p.trim().to_string(), String::new()),
        })
        .collect()
}

fn bad(what: &'static str, key: &str, value: &str, why: impl ToString) -> ConfigError {
    ConfigError::BadValue {
        what,
        key: key.into(),
        value: value.into(),
        why: why.to_string(),
    }
}

/// An on/off switch's value (`on`, `off` and their usual spellings; a bare key is on).
pub fn parse_on_off(v: &str) -> Result<bool, String> {
    match v {
        "on" | "true" | "yes" | "1" | "" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err("expected on or off".into()),
    }
}

/// When a port offers VIRTIO_F_RING_PACKED (`packed=auto|on|off`).
///
/// A packed ring has no used index in guest memory, so after a restart of gsonet
/// only the port's record of its rings' positions (`SOCKET.rings`, beside the
/// socket; `ring::packed::record`) says where to resume; without it a restarted
/// gsonet leaves a packed guest's queues stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PackedMode {
    /// Offered if the record can be kept (the default); else split rings only.
    #[default]
    Auto,
    /// Offered, with or without the record (a warning without it).
    On,
    /// Never offered.
    Off,
}

impl std::str::FromStr for PackedMode {
    type Err = String;

    fn from_str(v: &str) -> Result<Self, String> {
        match v {
            "auto" => Ok(PackedMode::Auto),
            _ => match parse_on_off(v) {
                Ok(true) => Ok(PackedMode::On),
                Ok(false) => Ok(PackedMode::Off),
                Err(_) => Err("expected auto, on or off".into()),
            },
        }
    }
}

impl fmt::Display for PackedMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PackedMode::Auto => "auto",
            PackedMode::On => "on",
            PackedMode::Off => "off",
        })
    }
}

/// Smallest and largest `max_burst` (an L3 packet: IPv4's minimum MTU to 64 KiB).
pub const MAX_BURST_RANGE: (usize, usize) = (68, 65535);

/// A `max_burst` value: 68..65535, or `off` (no limit).
pub fn parse_max_burst(v: &str) -> Result<Option<usize>, String> {
    let (lo, hi) = MAX_BURST_RANGE;
    match v {
        "off" | "none" | "0" => Ok(None),
        _ => v
            .parse::<usize>()
            .ok()
            .filter(|n| (lo..=hi).contains(n))
            .map(Some)
            .ok_or_else(|| format!("must be between {lo} and {hi}, or off")),
    }
}

fn on_off(what: &'static str, key: &str, v: &str) -> Result<bool, ConfigError> {
    parse_on_off(v).map_err(|e| bad(what, key, v, e))
}

fn max_burst(what: &'static str, key: &str, v: &str) -> Result<Option<usize>, ConfigError> {
    parse_max_burst(v).map_err(|e| bad(what, key, v, e))
}

fn number<T>(what: &'static str, key: &str, v: &str, lo: T, hi: T) -> Result<T, ConfigError>
where
    T: std::str::FromStr + PartialOrd + fmt::Display + Copy,
{
    let n: T = v
        .parse()
        .map_err(|_| bad(what, key, v, "expected a number"))?;
    if n < lo || n > hi {
        return Err(bad(what, key, v, format!("must be between {lo} and {hi}")));
    }
    Ok(n)
}

impl PortConfig {
    pub const KEYS: &'static str = "socket, client, queues, mac, mac_lock, mac_limit, mtu, max_burst, gro, rate, burst, rx_rate, rx_burst, vlan, trunk, allowed_vlans, allow_unsealed_memory, tx_poll_us, busy_poll_us, one_copy, packed (auto|on|off), in_order, rx_coalesce_usecs, rx_coalesce_frames, tx_coalesce_usecs, socket_mode, socket_group, and the offload switches offloads, csum, guest_csum, tso, ecn, ufo, uso, mrg_rxbuf, event_idx, indirect_desc (=on|off)";

    /// Parses `socket=PATH[,client][,queues=N][,mac=MAC[,mac_lock=on]][,mtu=N]
    /// [,vlan=N|,trunk=on,allowed_vlans=LIST][,socket_mode=0660][,socket_group=GROUP]
    /// [,tso=off]...`.
    pub fn parse(s: &str) -> Result<PortConfig, ConfigError> {
        Self::from_pairs(pairs(s))
    }

    fn from_pairs(kv: Vec<(String, String)>) -> Result<PortConfig, ConfigError> {
        const W: &str = "--port";
        let mut c = PortConfig {
            socket: PathBuf::new(),
            client: false,
            queues: 1,
            mac: None,
            mtu: 1500,
            max_burst: None,
            mask: FeatureMask::default(),
            vlan: None,
            trunk: None,
            mac_lock: false,
            gro: true,
            rate: None,
            rx_rate: None,
            mac_limit: PORT_MAC_LIMIT,
            allow_unsealed_memory: false,
            access: SocketAccess {
                mode: SocketAccess::PORT_MODE,
                group: None,
            },
            tx_poll_us: 0,
            busy_poll_us: DEFAULT_BUSY_POLL_US,
            one_copy: true,
            packed: PackedMode::Auto,
            in_order: true,
            rx_coalesce_usecs: 0,
            rx_coalesce_frames: 0,
            tx_coalesce_usecs: 0,
        };
        let mut trunk = None;
        let mut allowed = None;
        let mut access_key = None;
        let mut rate = None;
        let mut burst = None;
        let mut rx_rate = None;
        let mut rx_burst = None;
        for (k, v) in kv {
            match k.as_str() {
                "socket" | "path" => c.socket = PathBuf::from(&v),
                "client" => c.client = on_off(W, &k, &v)?,
                "server" => c.client = !on_off(W, &k, &v)?,
                "queues" => c.queues = number(W, &k, &v, 1, MAX_QUEUE_PAIRS)?,
                "mac" => c.mac = Some(v.parse().map_err(|e| bad(W, &k, &v, e))?),
                "mtu" => c.mtu = number(W, &k, &v, 68, 65535)?,
                "max_burst" => c.max_burst = max_burst(W, &k, &v)?,
                "vlan" => c.vlan = Vid::new(number(W, &k, &v, Vid::MIN, Vid::MAX)?),
                "mac_lock" => c.mac_lock = on_off(W, &k, &v)?,
                "gro" => c.gro = on_off(W, &k, &v)?,
                "rate" => rate = parse_rate(&v).map_err(|e| bad(W, &k, &v, e))?,
                "burst" => burst = Some(number(W, &k, &v, 1, BURST_KB_MAX)?),
                "rx_rate" => rx_rate = parse_rate(&v).map_err(|e| bad(W, &k, &v, e))?,
                "rx_burst" => rx_burst = Some(number(W, &k, &v, 1, BURST_KB_MAX)?),
                "mac_limit" => {
                    let (lo, hi) = MAC_LIMIT_RANGE;
                    c.mac_limit = number(W, &k, &v, lo, hi)?;
                }
                "trunk" => trunk = Some((on_off(W, &k, &v)?, v)),
                "allowed_vlans" => {
                    allowed = Some((v.parse::<VlanSet>().map_err(|e| bad(W, &k, &v, e))?, v))
                }
                "allow_unsealed_memory" => c.allow_unsealed_memory = on_off(W, &k, &v)?,
                "tx_poll_us" => c.tx_poll_us = number(W, &k, &v, 0, MAX_TX_POLL_US)?,
                "busy_poll_us" => c.busy_poll_us = number(W, &k, &v, 0, MAX_BUSY_POLL_US)?,
                "one_copy" => c.one_copy = on_off(W, &k, &v)?,
                "packed" => c.packed = v.parse().map_err(|e| bad(W, &k, &v, e))?,
                "in_order" => c.in_order = on_off(W, &k, &v)?,
                "rx_coalesce_usecs" => {
                    c.rx_coalesce_usecs = number(W, &k, &v, 0, MAX_RX_COALESCE_USECS)?
                }
                "rx_coalesce_frames" => {
                    c.rx_coalesce_frames = number(W, &k, &v, 0, MAX_RX_COALESCE_FRAMES)?
                }
                "tx_coalesce_usecs" => {
                    c.tx_coalesce_usecs = number(W, &k, &v, 0, MAX_TX_COALESCE_USECS)?
                }
                "socket_mode" => {
                    c.access.mode = parse_mode(&v).map_err(|e| bad(W, &k, &v, e))?;
                    access_key = Some((k, v));
                }
                "socket_group" => {
                    c.access.group = Some(parse_group(&v).map_err(|e| bad(W, &k, &v, e))?);
                    access_key = Some((k, v));
                }
                name if FeatureMask::NAMES.contains(&name) => {
                    let on = on_off(W, &k, &v)?;
                    c.mask.set(name, on);
                }
                _ => {
                    return Err(ConfigError::UnknownKey {
                        what: W,
                        key: k,
                        known: Self::KEYS.into(),
                    })
                }
            }
        }
        if c.socket.as_os_str().is_empty() {
            return Err(ConfigError::Missing {
                what: W,
                key: "socket",
            });
        }
        c.rate = RateLimit::with_burst(rate, burst).map_err(|e| bad(W, "burst", "", e))?;
        c.rx_rate =
            RateLimit::with_burst(rx_rate, rx_burst).map_err(|e| bad(W, "rx_burst", "", e))?;
        if c.mac_lock && c.mac.is_none() {
            return Err(bad(
                W,
                "mac_lock",
                "on",
                "a locked port may send only from its own address: give mac=MAC too",
            ));
        }
        match (trunk, allowed) {
            (Some((true, v)), None) => {
                return Err(bad(
                    W,
                    "trunk",
                    &v,
                    "a trunk port needs allowed_vlans=LIST, e.g. allowed_vlans=10-20:30",
                ))
            }
            (Some((true, _)), Some((set, _))) => {
                if let Some(vid) = c.vlan {
                    return Err(bad(
                        W,
                        "vlan",
                        &vid.to_string(),
                        "a trunk=on port carries its VLANs tagged; it cannot also be an access port",
                    ));
                }
                c.trunk = Some(set);
            }
            (_, Some((_, v))) => {
                return Err(bad(
                    W,
                    "allowed_vlans",
                    &v,
                    "only a trunk=on port has allowed VLANs",
                ))
            }
            _ => {}
        }
        if let (true, Some((k, v))) = (c.client, access_key) {
            return Err(bad(
                W,
                &k,
                &v,
                "a client port connects to QEMU's socket; set its mode where QEMU creates it",
            ));
        }
        Ok(c)
    }
}

impl UplinkConfig {
    /// `tap=NAME` or `dev=NAME`, as the uplink is shown (and known to a reload).
    pub fn name(&self) -> String {
        match &self.kind {
            UplinkKind::Tap(n) => format!("tap={n}"),
            UplinkKind::Dev { name, .. } => format!("dev={name}"),
        }
    }

    pub const KEYS: &'static str =
        "tap or dev, queues, gso (pass|software), max_burst, rate, burst, rx_rate, rx_burst, bypass (dev only, on|off), mac and persist (tap only, on|off)";

    /// Parses `tap=NAME|dev=IFNAME[,queues=N][,gso=pass|software][,max_burst=N][,rate=MBIT]
    /// [,burst=KB][,rx_rate=MBIT][,rx_burst=KB][,bypass=on|off]`.
    pub fn parse(s: &str) -> Result<UplinkConfig, ConfigError> {
        Self::from_pairs(pairs(s))
    }

    fn from_pairs(kv: Vec<(String, String)>) -> Result<UplinkConfig, ConfigError> {
        const W: &str = "--uplink";
        let mut kind = None;
        let mut c = UplinkConfig {
            kind: UplinkKind::Tap(String::new()),
            queues: None,
            gso: GsoMode::Pass,
            max_burst: None,
            rate: None,
            rx_rate: None,
            mac: None,
            persist: true,
        };
        let mut bypass = None;
        let mut tap_only = None;
        let mut rate = None;
        let mut burst = None;
        let mut rx_rate = None;
        let mut rx_burst = None;
        for (k, v) in kv {
            match k.as_str() {
                "tap" | "dev" => {
                    if v.is_empty() || v.len() > 15 {
                        return Err(bad(W, &k, &v, "an interface name is 1 to 15 bytes"));
                    }
                    if kind.is_some() {
                        return Err(bad(W, &k, &v, "an uplink is one tap= or one dev="));
                    }
                    kind = Some(if k == "tap" {
                        UplinkKind::Tap(v)
                    } else {
                        UplinkKind::Dev {
                            name: v,
                            bypass: false,
                        }
                    });
                }
                "queues" => c.queues = Some(number(W, &k, &v, 1, MAX_QUEUE_PAIRS)?),
                "gso" => c.gso = v.parse().map_err(|e| bad(W, &k, &v, e))?,
                "max_burst" => c.max_burst = max_burst(W, &k, &v)?,
                "bypass" => bypass = Some((on_off(W, &k, &v)?, v)),
                "mac" => {
                    c.mac = Some(v.parse().map_err(|e| bad(W, &k, &v, e))?);
                    tap_only = Some((k, v));
                }
                "persist" => {
                    c.persist = on_off(W, &k, &v)?;
                    tap_only = Some((k, v));
                }
                "rate" => rate = parse_rate(&v).map_err(|e| bad(W, &k, &v, e))?,
                "burst" => burst = Some(number(W, &k, &v, 1, BURST_KB_MAX)?),
                "rx_rate" => rx_rate = parse_rate(&v).map_err(|e| bad(W, &k, &v, e))?,
                "rx_burst" => rx_burst = Some(number(W, &k, &v, 1, BURST_KB_MAX)?),
                _ => {
                    return Err(ConfigError::UnknownKey {
                        what: W,
                        key: k,
                        known: Self::KEYS.into(),
                    })
                }
            }
        }
        c.kind = kind.ok_or(ConfigError::Missing {
            what: W,
            key: "tap or dev",
        })?;
        c.rate = RateLimit::with_burst(rate, burst).map_err(|e| bad(W, "burst", "", e))?;
        c.rx_rate =
            RateLimit::with_burst(rx_rate, rx_burst).map_err(|e| bad(W, "rx_burst", "", e))?;
        if let (Some((k, v)), UplinkKind::Dev { .. }) = (&tap_only, &c.kind) {
            return Err(bad(
                W,
                k,
                v,
                "only a tap= uplink is gsonet's own device (mac=, persist=)",
            ));
        }
        if let (Some((k, v)), UplinkKind::Dev { .. }) = (&tap_only, &c.kind) {
            return Err(bad(
                W,
                k,
                v,
                "only a tap= uplink is gsonet's own device (mac=, persist=)",
            ));
        }
        if let Some((on, v)) = bypass {
            match &mut c.kind {
                UplinkKind::Dev { bypass, .. } => *bypass = on,
                UplinkKind::Tap(_) => {
                    return Err(bad(
                        W,
                        "bypass",
                        &v,
                        "only a dev= uplink has a qdisc to bypass",
                    ))
                }
            }
        }
        Ok(c)
    }
}

/// Which vifs a `--xen-vif` serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XenVifTarget {
    /// backend/vif/DOMID/DEVID.
    One { domid: u16, devid: u32 },
    /// Every vif that appears under backend/vif/, at most `max` at once.
    Auto { max: usize },
}

/// A Xen netback vif (`--xen-vif`, TOML `[[xen_vif]]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XenVifConfig {
    pub target: XenVifTarget,
    pub mac: Option<Mac>,
    /// Advertise and accept TCP segmentation (feature-gso-tcpv4/v6).
    pub tso: bool,
    /// Take and hand partial checksums (off: every checksum completed in gsonet).
    pub csum: bool,
    /// Write a TX batch's frames to a tap with one io_uring submission, not a writev
    /// each (where io_uring is available).
    pub uring: bool,
    /// The nice value of the vif's worker threads.
    pub nice: i32,
    /// Most queues a netfront may open (`multi-queue-max-queues`), each with its own
    /// worker thread: 1 to `XEN_MAX_QUEUES`.
    pub queues: usize,
}

/// A vif worker's default nice value. A little above the processes it serves: the
/// process reading what the guest sent, woken by it, then does not preempt the
/// worker halfway through a batch, so both take bigger bites (in the nested Xen rig,
/// domU -> dom0 1.31x, context switches per GB 18.5k -> 5.1k). Much higher (-10) and
/// the worker preempts the process sending to the guest at each frame instead
/// (dom0 -> domU 0.61x).
pub const XEN_WORKER_NICE: i32 = -5;

/// Most vifs `--xen-vif auto` serves at once, unless `max=` says otherwise.
pub const XEN_AUTO_MAX: usize = 8;

/// Most queues per vif (`queues=`): Linux's netfront asks for no more by default.
pub const XEN_MAX_QUEUES: usize = 8;

/// A vif's queues unless `queues=` says otherwise: one per dom0 CPU, at most
/// `XEN_MAX_QUEUES` (a netfront asks for one per vCPU of its own, up to this).
pub fn xen_default_queues() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, XEN_MAX_QUEUES)
}

impl XenVifConfig {
    pub const KEYS: &'static str =
        "domid (or auto), devid, max (auto only), mac, tso, csum, uring, nice, queues";

    /// Parses `domid=D[,devid=N][,mac=MAC][,tso=on|off][,csum=on|off][,uring=on|off]
    /// [,nice=N][,queues=N]` or `auto[,max=N]` with the same switches.
    pub fn parse(s: &str) -> Result<XenVifConfig, ConfigError> {
        Self::from_pairs(pairs(s))
    }

    fn from_pairs(kv: Vec<(String, String)>) -> Result<XenVifConfig, ConfigError> {
        const W: &str = "--xen-vif";
        let (mut domid, mut devid, mut max, mut auto) = (None, None, None, false);
        let mut c = XenVifConfig {
            target: XenVifTarget::Auto { max: XEN_AUTO_MAX },
            mac: None,
            tso: true,
            csum: true,
            uring: true,
            nice: XEN_WORKER_NICE,
            queues: xen_default_queues(),
        };
        for (k, v) in kv {
            match k.as_str() {
                "auto" => auto = v.is_empty() || on_off(W, &k, &v)?,
                "domid" => domid = Some(number(W, &k, &v, 1u16, 0x7fef)?),
                "devid" => devid = Some(number(W, &k, &v, 0u32, 65535)?),
                "max" => max = Some(number(W, &k, &v, 1usize, 256)?),
                "mac" => {
                    let m: Mac = v.parse().map_err(|e| bad(W, &k, &v, e))?;
                    if m.is_multicast() {
                        return Err(bad(W, &k, &v, "a multicast address cannot be a vif's"));
                    }
                    c.mac = Some(m);
                }
                "tso" => c.tso = on_off(W, &k, &v)?,
                "csum" => c.csum = on_off(W, &k, &v)?,
                "uring" => c.uring = on_off(W, &k, &v)?,
                "nice" => c.nice = number(W, &k, &v, -20i32, 19)?,
                "queues" => c.queues = number(W, &k, &v, 1usize, XEN_MAX_QUEUES)?,
                _ => {
                    return Err(ConfigError::UnknownKey {
                        what: W,
                        key: k,
                        known: Self::KEYS.into(),
                    })
                }
            }
        }
        c.target = match (auto, domid) {
            (true, Some(d)) => {
                return Err(bad(
                    W,
                    "domid",
                    &d.to_string(),
                    "auto serves every domain; give one or the other",
                ))
            }
            (true, None) => {
                if devid.is_some() || c.mac.is_some() {
                    return Err(bad(
                        W,
                        "auto",
                        "",
                        "auto takes max=, queues=, tso=, csum=, uring= and nice= only",
                    ));
                }
                XenVifTarget::Auto {
                    max: max.unwrap_or(XEN_AUTO_MAX),
                }
            }
            (false, Some(domid)) => {
                if let Some(m) = max {
                    return Err(bad(W, "max", &m.to_string(), "only auto has a maximum"));
                }
                XenVifTarget::One {
                    domid,
                    devid: devid.unwrap_or(0),
                }
            }
            (false, None) => {
                return Err(ConfigError::Missing {
                    what: W,
                    key: "domid (or auto)",
                })
            }
        };
        if !c.csum {
            c.tso = false;
        }
        Ok(c)
    }
}

/// The whole daemon configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub ports: Vec<PortConfig>,
    pub uplinks: Vec<UplinkConfig>,
    pub control: PathBuf,
    /// Mode and group of the control socket (default 0600, gsonet's own group).
    pub control_access: SocketAccess,
    pub mac_aging_secs: u64,
    /// Where to serve Prometheus metrics (`--metrics`, `metrics = "ADDR:PORT"`); none: off.
    pub metrics: Option<std::net::SocketAddr>,
    /// The `--config` file this came from, if any: a reload reads it again.
    pub file: Option<FileOrigin>,
    /// Xen netback vifs (`--xen-vif`, `[[xen_vif]]`).
    pub xen_vifs: Vec<XenVifConfig>,
}

/// Where a configuration's file part came from: its first `ports` ports and first
/// `uplinks` uplinks are the file's (the command line's follow them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileOrigin {
    pub path: PathBuf,
    pub ports: usize,
    pub uplinks: usize,
}

/// A `--metrics`/`metrics` address: an IP address and a port, e.g. `127.0.0.1:9477`.
pub fn parse_metrics_addr(v: &str) -> Result<std::net::SocketAddr, ConfigError> {
    v.parse().map_err(|_| ConfigError::BadValue {
        what: "metrics",
        key: "metrics".into(),
        value: v.into(),
        why: "expected ADDR:PORT, e.g. 127.0.0.1:9477 or [::1]:9477".into(),
    })
}

pub const DEFAULT_CONTROL: &str = "/run/gsonet/control.sock";

/// The TOML file: `control = "..."`, `control_mode`, `control_group`, `mac_aging = 300`,
/// `[[port]]` and `[[uplink]]` tables with the same keys as the command line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    control: Option<PathBuf>,
    control_mode: Option<toml::Value>,
    control_group: Option<toml::Value>,
    mac_aging: Option<u64>,
    metrics: Option<String>,
    #[serde(default)]
    port: Vec<BTreeMap<String, toml::Value>>,
    #[serde(default)]
    uplink: Vec<BTreeMap<String, toml::Value>>,
    #[serde(default)]
    xen_vif: Vec<BTreeMap<String, toml::Value>>,
}

/// A TOML value as the command line would spell it. A mode written as a TOML integer
/// (`0o660`) is read back in octal; `660`, a decimal integer, is then out of range.
fn toml_text(key: &str, v: toml::Value) -> String {
    match v {
        toml::Value::String(s) => s,
        toml::Value::Boolean(b) => (if b { "on" } else { "off" }).to_string(),
        toml::Value::Integer(i) if key.ends_with("_mode") => format!("0o{i:o}"),
        // A list (allowed_vlans = [10, "20-30"]) as the command line writes it.
        toml::Value::Array(a) => a
            .into_iter()
            .map(|v| match v {
                toml::Value::String(s) => s,
                other => other.to_string(),
            })
            .collect::<Vec<_>>()
            .join(":"),
        other => other.to_string(),
    }
}

fn toml_pairs(t: BTreeMap<String, toml::Value>) -> Vec<(String, String)> {
    t.into_iter()
        .map(|(k, v)| {
            let s = toml_text(&k, v);
            (k, s)
        })
        .collect()
}

impl SocketAccess {
    /// Overrides the mode and/or the group, from `control_mode`/`control_group` (file)
    /// or `--control-mode`/`--control-group` (command line); `what` says which.
    pub fn with(
        mut self,
        what: &'static str,
        mode: Option<(&str, &str)>,
        group: Option<(&str, &str)>,
    ) -> Result<SocketAccess, ConfigError> {
        if let Some((k, v)) = mode {
            self.mode = parse_mode(v).map_err(|e| bad(what, k, v, e))?;
        }
        if let Some((k, v)) = group {
            self.group = Some(parse_group(v).map_err(|e| bad(what, k, v, e))?);
        }
        Ok(self)
    }
}

impl Config {
    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            path: path.display().to_string(),
            err: e.to_string(),
        })?;
        let mut cfg = Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Toml { err, .. } => ConfigError::Toml {
                path: path.display().to_string(),
                err,
            },
            other => other,
        })?;
        cfg.file = Some(FileOrigin {
            path: path.to_path_buf(),
            ports: cfg.ports.len(),
            uplinks: cfg.uplinks.len(),
        });
        Ok(cfg)
    }

    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let f: FileConfig = toml::from_str(text).map_err(|e| ConfigError::Toml {
            path: String::new(),
            err: e.to_string(),
        })?;
        let ports = f
            .port
            .into_iter()
            .map(|t| PortConfig::from_pairs(toml_pairs(t)))
            .collect::<Result<_, _>>()?;
        let uplinks = f
            .uplink
            .into_iter()
            .map(|t| UplinkConfig::from_pairs(toml_pairs(t)))
            .collect::<Result<_, _>>()?;
        let xen_vifs = f
            .xen_vif
            .into_iter()
            .map(|t| XenVifConfig::from_pairs(toml_pairs(t)))
            .collect::<Result<_, _>>()?;
        let mode = f.control_mode.map(|v| toml_text("control_mode", v));
        let group = f.control_group.map(|v| toml_text("control_group", v));
        Ok(Config {
            ports,
            uplinks,
            control: f.control.unwrap_or_else(|| DEFAULT_CONTROL.into()),
            control_access: SocketAccess {
                mode: SocketAccess::CONTROL_MODE,
                group: None,
            }
            .with(
                "config file",
                mode.as_deref().map(|v| ("control_mode", v)),
                group.as_deref().map(|v| ("control_group", v)),
            )?,
            mac_aging_secs: f.mac_aging.unwrap_or(300),
            metrics: f.metrics.as_deref().map(parse_metrics_addr).transpose()?,
            file: None,
            xen_vifs,
        })
    }

    /// Checks what only the whole configuration can tell.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.ports.is_empty() && self.xen_vifs.is_empty() {
            return Err(ConfigError::NoPorts);
        }
        let mut seen = std::collections::HashSet::new();
        for p in &self.ports {
            if !seen.insert(&p.socket) {
                return Err(ConfigError::DuplicateSocket(p.socket.display().to_string()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_string_with_every_key() {
        let p = PortConfig::parse(
            "socket=/tmp/a.sock,client,queues=2,mac=52:54:00:00:00:01,mtu=9000,tso=off,ufo=off",
        )
        .unwrap();
        assert_eq!(p.socket, PathBuf::from("/tmp/a.sock"));
        assert!(p.client);
        assert_eq!(p.queues, 2);
        assert_eq!(p.mac.unwrap().to_string(), "52:54:00:00:00:01");
        assert_eq!(p.mtu, 9000);
        assert!(!p.mask.tso && !p.mask.ufo && p.mask.uso);
    }

    #[test]
    fn packed_is_auto_on_or_off() {
        assert_eq!(
            PortConfig::parse("socket=a").unwrap().packed,
            PackedMode::Auto
        );
        for (v, want) in [
            ("auto", PackedMode::Auto),
            ("on", PackedMode::On),
            ("true", PackedMode::On),
            ("", PackedMode::On),
            ("off", PackedMode::Off),
            ("no", PackedMode::Off),
        ] {
            let p = PortConfig::parse(&format!("socket=a,packed={v}")).unwrap();
            assert_eq!(p.packed, want, "packed={v}");
        }
        assert_eq!(PackedMode::Auto.to_string(), "auto");
        for v in ["maybe", "Auto", "2"] {
            match PortConfig::parse(&format!("socket=a,packed={v}")) {
                Err(e @ ConfigError::BadValue { .. }) => {
                    assert!(e.to_string().contains("expected auto, on or off"), "{e}")
                }
                other => panic!("packed={v}: {other:?}"),
            }
        }
        // In a file: a string, or a boolean for on and off.
        let t: BTreeMap<String, toml::Value> =
            toml::from_str("socket = \"a\"\npacked = \"auto\"").unwrap();
        assert_eq!(
            PortConfig::from_pairs(toml_pairs(t)).unwrap().packed,
            PackedMode::Auto
        );
        let t: BTreeMap<String, toml::Value> =
            toml::from_str("socket = \"a\"\npacked = false").unwrap();
        assert_eq!(
            PortConfig::from_pairs(toml_pairs(t)).unwrap().packed,
            PackedMode::Off
        );
    }

    #[test]
    fn port_errors_name_the_key() {
        assert_eq!(
            PortConfig::parse("queues=2"),
            Err(ConfigError::Missing {
                what: "--port",
                key: "socket"
            })
        );
        assert!(matches!(
            PortConfig::parse("socket=a,turbo=on"),
            Err(ConfigError::UnknownKey { .. })
        ));
        assert!(matches!(
            PortConfig::parse("socket=a,queues=0"),
            Err(ConfigError::BadValue { .. })
        ));
        assert!(matches!(
            PortConfig::parse("socket=a,tso=maybe"),
            Err(ConfigError::BadValue { .. })
        ));
        assert!(matches!(
            PortConfig::parse("socket=a,mac=01:00:00:00:00:01"),
            Err(ConfigError::BadValue { .. })
        ));
        assert!(matches!(
            PortConfig::parse("socket=a,mac=zz"),
            Err(ConfigError::BadValue { .. })
        ));
        assert!(matches!(
            PortConfig::parse("socket=a,tx_coalesce_usecs=10001"),
            Err(ConfigError::BadValue { .. })
        ));
    }

    #[test]
    fn tx_coalesce_usecs_is_off_unless_given() {
        assert_eq!(PortConfig::parse("socket=a").unwrap().tx_coalesce_usecs, 0);
        let p = PortConfig::parse("socket=a,tx_coalesce_usecs=300").unwrap();
        assert_eq!(p.tx_coalesce_usecs, 300);
    }

    #[test]
    fn uplink_string() {
        let u = UplinkConfig::parse("tap=gs0,gso=software,queues=2,max_burst=1400").unwrap();
        assert_eq!(u.kind, UplinkKind::Tap("gs0".into()));
        assert_eq!(
            (u.gso, u.queues, u.max_burst),
            (GsoMode::Software, Some(2), Some(1400))
        );
        assert!(UplinkConfig::parse("gso=pass").is_err());
        assert!(UplinkConfig::parse("tap=a-name-that-is-too-long").is_err());
        assert!(UplinkConfig::parse("tap=x,gso=fast").is_err());
        // A tap is persistent unless told otherwise; mac= and persist= are tap-only.
        assert!(u.persist && u.mac.is_none());
        let t = UplinkConfig::parse("tap=gs0,mac=02:00:00:00:00:07,persist=off").unwrap();
        assert_eq!(t.mac.unwrap().to_string(), "02:00:00:00:00:07");
        assert!(!t.persist);
        assert!(UplinkConfig::parse("tap=gs0,mac=ff:ff:ff:ff:ff:ff").is_err());
        assert!(UplinkConfig::parse("tap=gs0,persist=maybe").is_err());
        assert!(UplinkConfig::parse("dev=eth0,persist=off").is_err());
        assert!(UplinkConfig::parse("dev=eth0,mac=02:00:00:00:00:07").is_err());
    }

    #[test]
    fn dev_uplink_string() {
        let u = UplinkConfig::parse("dev=eth1,gso=software,max_burst=1400,bypass=on").unwrap();
        assert_eq!(
            u.kind,
            UplinkKind::Dev {
                name: "eth1".into(),
                bypass: true
            }
        );
        assert_eq!((u.gso, u.max_burst), (GsoMode::Software, Some(1400)));
        let u = UplinkConfig::parse("dev=veth0").unwrap();
        assert_eq!(
            u.kind,
            UplinkKind::Dev {
                name: "veth0".into(),
                bypass: false
            }
        );
        assert_eq!(u.gso, GsoMode::Pass);
        assert!(UplinkConfig::parse("tap=gs0,bypass=on").is_err());
        assert!(UplinkConfig::parse("dev=eth0,bypass=maybe").is_err());
        assert!(UplinkConfig::parse("dev=eth0,tap=gs0").is_err());
        assert!(UplinkConfig::parse("dev=").is_err());
        let c = Config::from_toml("[[uplink]]\ndev = 'eth2'\nbypass = true\nqueues = 2").unwrap();
        assert_eq!(
            c.uplinks[0].kind,
            UplinkKind::Dev {
                name: "eth2".into(),
                bypass: true
            }
        );
        assert_eq!(c.uplinks[0].queues, Some(2));
    }

    #[test]
    fn toml_file_uses_the_same_keys() {
        let c = Config::from_toml(
            r#"
            control = "/tmp/ctl.sock"
            [[port]]
            socket = "/tmp/vm1.sock"
            tso = false
            queues = 2
            [[port]]
            socket = "/tmp/vm2.sock"
            client = true
            [[uplink]]
            tap = "gsonet0"
            gso = "software"
            "#,
        )
        .unwrap();
        assert_eq!(c.ports.len(), 2);
        assert!(!c.ports[0].mask.tso && c.ports[0].queues == 2);
        assert!(c.ports[1].client);
        assert_eq!(c.uplinks[0].gso, GsoMode::Software);
        assert_eq!(c.control, PathBuf::from("/tmp/ctl.sock"));
        c.check().unwrap();
        assert!(Config::from_toml("[[port]]\nsocket='a'\nbogus=1").is_err());
        assert!(Config::from_toml("[[prot]]\nsocket='a'").is_err());
    }

    #[test]
    fn access_vlan() {
        assert_eq!(PortConfig::parse("socket=a").unwrap().vlan, None);
        let p = PortConfig::parse("socket=a,vlan=10").unwrap();
        assert_eq!(p.vlan.map(|v| v.get()), Some(10));
        assert_eq!(
            PortConfig::parse("socket=a,vlan=4094").unwrap().vlan,
            Vid::new(4094)
        );
        for bad in ["0", "4095", "x", "", "-1"] {
            assert!(
                matches!(
                    PortConfig::parse(&format!("socket=a,vlan={bad}")),
                    Err(ConfigError::BadValue { .. })
                ),
                "vlan={bad}"
            );
        }
        let c = Config::from_toml("[[port]]\nsocket='a'\nvlan=20\n[[port]]\nsocket='b'").unwrap();
        assert_eq!(c.ports[0].vlan, Vid::new(20));
        assert_eq!(c.ports[1].vlan, None);
        assert!(Config::from_toml("[[port]]\nsocket='a'\nvlan=5000").is_err());
    }

    #[test]
    fn trunk_ports_and_port_security() {
        let p = PortConfig::parse("socket=a,trunk=on,allowed_vlans=10-20:30").unwrap();
        let t = p.trunk.unwrap();
        assert!(t.contains(10) && t.contains(20) && t.contains(30) && !t.contains(21));
        assert_eq!(p.vlan, None);
        let p = PortConfig::parse("socket=a,allowed_vlans=5,trunk").unwrap();
        assert_eq!(p.trunk.unwrap().to_string(), "5");
        assert_eq!(PortConfig::parse("socket=a").unwrap().trunk, None);
        assert!(PortConfig::parse("socket=a,trunk=off")
            .unwrap()
            .trunk
            .is_none());
        let err = |s: &str| PortConfig::parse(s).unwrap_err().to_string();
        assert!(err("socket=a,trunk=on").contains("needs allowed_vlans="));
        assert!(err("socket=a,allowed_vlans=10").contains("only a trunk=on port"));
        assert!(err("socket=a,trunk=off,allowed_vlans=10").contains("only a trunk=on port"));
        assert!(err("socket=a,trunk=on,allowed_vlans=10,vlan=10").contains("cannot also be"));
        assert!(err("socket=a,vlan=10,trunk=on,allowed_vlans=10").contains("cannot also be"));
        for bad in ["0", "4095", "20-10", "x", "10;20"] {
            assert!(
                err(&format!("socket=a,trunk=on,allowed_vlans={bad}")).contains("allowed_vlans"),
                "{bad}"
            );
        }
        assert!(err("socket=a,trunk=maybe,allowed_vlans=1").contains("trunk"));

        let p = PortConfig::parse("socket=a,rate=200,burst=64,gro=off").unwrap();
        assert_eq!(
            (p.rate, p.gro),
            (
                Some(RateLimit {
                    mbit: 200,
                    burst_kb: 64
                }),
                false
            )
        );
        let p = PortConfig::parse("socket=a,rate=5").unwrap();
        assert_eq!(p.rate.map(|r| r.burst_kb), Some(BURST_KB_DEFAULT));
        assert!(p.gro);
        assert_eq!(PortConfig::parse("socket=a,rate=off").unwrap().rate, None);
        assert!(err("socket=a,burst=64").contains("burst= needs rate="));
        let p = PortConfig::parse("socket=a,rx_rate=300,rx_burst=32").unwrap();
        assert_eq!(
            p.rx_rate,
            Some(RateLimit {
                mbit: 300,
                burst_kb: 32
            })
        );
        assert!(err("socket=a,rx_burst=32").contains("burst= needs rate="));
        let u = UplinkConfig::parse("tap=t0,rate=100").unwrap();
        assert_eq!(
            u.rate.map(|r| (r.mbit, r.burst_kb)),
            Some((100, BURST_KB_DEFAULT))
        );
        assert!(UplinkConfig::parse("tap=t0,burst=5").is_err());
        let u = UplinkConfig::parse("tap=t0,rx_rate=50,rx_burst=16").unwrap();
        assert_eq!(u.rx_rate.map(|r| (r.mbit, r.burst_kb)), Some((50, 16)));
        assert_eq!(u.rate, None);
        assert!(UplinkConfig::parse("tap=t0,rx_burst=5").is_err());
        assert!(err("socket=a,rate=0.5").contains("Mbit/s"));
        assert!(err("socket=a,rate=200,burst=0").contains("burst"));
        let p = PortConfig::parse("socket=a,mac=52:54:00:00:00:01,mac_lock=on").unwrap();
        assert!(p.mac_lock);
        assert!(!PortConfig::parse("socket=a").unwrap().mac_lock);
        assert!(err("socket=a,mac_lock=on").contains("give mac=MAC"));
        assert!(PortConfig::parse("socket=a,mac_lock=off").is_ok());

        assert_eq!(
            PortConfig::parse("socket=a").unwrap().mac_limit,
            PORT_MAC_LIMIT
        );
        assert_eq!(
            PortConfig::parse("socket=a,mac_limit=4").unwrap().mac_limit,
            4
        );
        for bad in ["0", "65537", "x"] {
            assert!(err(&format!("socket=a,mac_limit={bad}")).contains("mac_limit"));
        }

        let c = Config::from_toml(
            r#"
            [[port]]
            socket = "a"
            trunk = true
            allowed_vlans = [10, "20-22"]
            [[port]]
            socket = "b"
            trunk = "on"
            allowed_vlans = "7"
            mac = "52:54:00:00:00:02"
            mac_lock = true
            mac_limit = 16
            "#,
        )
        .unwrap();
        assert_eq!(c.ports[0].trunk.as_ref().unwrap().to_string(), "10:20-22");
        assert_eq!(c.ports[1].trunk.as_ref().unwrap().to_string(), "7");
        assert!(c.ports[1].mac_lock && c.ports[1].mac_limit == 16);
        assert!(Config::from_toml("[[port]]\nsocket='a'\nmac_lock=true").is_err());
        assert!(Config::from_toml("[[port]]\nsocket='a'\ntrunk=true").is_err());
    }

    #[test]
    fn unsealed_memory_is_refused_unless_allowed() {
        assert!(!PortConfig::parse("socket=a").unwrap().allow_unsealed_memory);
        assert!(
            PortConfig::parse("socket=a,allow_unsealed_memory=on")
                .unwrap()
                .allow_unsealed_memory
        );
        assert!(
            PortConfig::parse("socket=a,allow_unsealed_memory")
                .unwrap()
                .allow_unsealed_memory
        );
        assert!(matches!(
            PortConfig::parse("socket=a,allow_unsealed_memory=maybe"),
            Err(ConfigError::BadValue { .. })
        ));
        let c = Config::from_toml("[[port]]\nsocket='a'\nallow_unsealed_memory=true").unwrap();
        assert!(c.ports[0].allow_unsealed_memory);
    }

    #[test]
    fn socket_mode_and_group() {
        let p = PortConfig::parse("socket=a").unwrap();
        assert_eq!(
            p.access,
            SocketAccess {
                mode: 0o660,
                group: None
            }
        );
        let p = PortConfig::parse("socket=a,socket_mode=0640,socket_group=kvm").unwrap();
        assert_eq!(p.access.mode, 0o640);
        assert_eq!(p.access.group, Some(GroupSpec::Name("kvm".into())));
        for (v, m) in [("600", 0o600), ("0o770", 0o770), ("0", 0), ("0777", 0o777)] {
            let p = PortConfig::parse(&format!("socket=a,socket_mode={v}")).unwrap();
            assert_eq!(p.access.mode, m, "socket_mode={v}");
        }
        let p = PortConfig::parse("socket=a,socket_group=107").unwrap();
        assert_eq!(p.access.group, Some(GroupSpec::Id(107)));
        for bad in [
            "socket_mode=",
            "socket_mode=0688",
            "socket_mode=4755",
            "socket_mode=rw",
            "socket_mode=-1",
            "socket_group=",
            "socket_group=a:b",
            "socket_group=4294967295",
            "socket_group=99999999999",
            "client,socket_mode=0600",
            "socket_group=kvm,client",
        ] {
            assert!(
                matches!(
                    PortConfig::parse(&format!("socket=a,{bad}")),
                    Err(ConfigError::BadValue { .. })
                ),
                "{bad}"
            );
        }
        // TOML: a string, or an octal integer; a decimal 660 is not taken for 0660.
        let c = Config::from_toml(
            "control_mode = '0660'\ncontrol_group = 'kvm'\n[[port]]\nsocket='a'\nsocket_mode=0o600\nsocket_group=107\n[[port]]\nsocket='b'\nsocket_mode='0640'",
        )
        .unwrap();
        assert_eq!(c.ports[0].access.mode, 0o600);
        assert_eq!(c.ports[0].access.group, Some(GroupSpec::Id(107)));
        assert_eq!(c.ports[1].access.mode, 0o640);
        assert_eq!(c.control_access.mode, 0o660);
        assert_eq!(c.control_access.group, Some(GroupSpec::Name("kvm".into())));
        let err = Config::from_toml("[[port]]\nsocket='a'\nsocket_mode=660").unwrap_err();
        assert!(err.to_string().contains("0660"), "{err}");
        assert!(Config::from_toml("control_mode = 660").is_err());
        assert!(Config::from_toml("control_mode = '9'").is_err());
        assert!(Config::from_toml("control_group = ''").is_err());
        let c = Config::from_toml("").unwrap();
        assert_eq!(
            c.control_access,
            SocketAccess {
                mode: 0o600,
                group: None
            }
        );
    }

    #[test]
    fn whole_config_checks() {
        let mut c = Config::from_toml("").unwrap();
        assert_eq!(c.check(), Err(ConfigError::NoPorts));
        c.ports.push(PortConfig::parse("socket=a").unwrap());
        c.ports.push(PortConfig::parse("socket=a").unwrap());
        assert!(matches!(c.check(), Err(ConfigError::DuplicateSocket(_))));
    }

    #[test]
    fn metrics_address() {
        assert_eq!(Config::from_toml("").unwrap().metrics, None);
        let c = Config::from_toml("metrics = '127.0.0.1:9477'").unwrap();
        assert_eq!(c.metrics, Some("127.0.0.1:9477".parse().unwrap()));
        let c = Config::from_toml("metrics = '[::1]:9000'").unwrap();
        assert_eq!(c.metrics, Some("[::1]:9000".parse().unwrap()));
        for bad in [
            "metrics = 'localhost'",
            "metrics = '127.0.0.1'",
            "metrics = 9477",
        ] {
            assert!(Config::from_toml(bad).is_err(), "{bad}");
        }
        let err = parse_metrics_addr("9477").unwrap_err();
        assert!(err.to_string().contains("ADDR:PORT"), "{err}");
    }

    #[test]
    fn xen_vif_specs() {
        let one = XenVifConfig::parse("domid=3,devid=1,mac=00:16:3e:00:00:05,tso=off").unwrap();
        assert_eq!(one.target, XenVifTarget::One { domid: 3, devid: 1 });
        assert!(!one.tso && one.csum && one.mac.is_some());
        let auto = XenVifConfig::parse("auto,max=2").unwrap();
        assert_eq!(auto.target, XenVifTarget::Auto { max: 2 });
        assert_eq!(
            XenVifConfig::parse("auto").unwrap().target,
            XenVifTarget::Auto { max: XEN_AUTO_MAX }
        );
        // csum=off takes TSO with it.
        assert!(!XenVifConfig::parse("domid=1,csum=off").unwrap().tso);
        assert!(one.uring, "batched tap writes are the default");
        assert!(!XenVifConfig::parse("auto,uring=off").unwrap().uring);
        assert_eq!(one.nice, XEN_WORKER_NICE);
        assert_eq!(XenVifConfig::parse("auto,nice=0").unwrap().nice, 0);
        assert_eq!(XenVifConfig::parse("domid=2,nice=-20").unwrap().nice, -20);
        assert_eq!(XenVifConfig::parse("auto,queues=2").unwrap().queues, 2);
        let q = XenVifConfig::parse("auto").unwrap().queues;
        assert!((1..=XEN_MAX_QUEUES).contains(&q), "{q}");
        for bad in [
            "",
            "devid=1",
            "auto,domid=2",
            "domid=1,max=3",
            "auto,mac=00:16:3e:00:00:05",
            "domid=0",
            "domid=1,mac=01:00:5e:00:00:01",
            "domid=1,color=red",
            "auto,max=0",
            "domid=1,uring=maybe",
            "domid=1,nice=-21",
            "auto,nice=20",
            "auto,nice=high",
            "auto,queues=0",
            "auto,queues=9",
        ] {
            assert!(XenVifConfig::parse(bad).is_err(), "{bad:?} accepted");
        }
        let c = Config::from_toml("[[xen_vif]]\ndomid = 4\ntso = false\nnice = -2\n").unwrap();
        assert_eq!(c.xen_vifs.len(), 1);
        assert!(!c.xen_vifs[0].tso);
        assert_eq!(c.xen_vifs[0].nice, -2);
        c.check().unwrap();
    }
}
