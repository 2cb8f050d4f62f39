//! Announcing a guest at its port after a live migration: the RARP broadcast QEMU's
//! SEND_RARP asks for, sent into the switch as if the guest had sent it, so every FDB
//! entry of its address moves to this port at once.

use tracing::info;

use super::port::Port;
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::{Endpoint, Switch};
use crate::features::Caps;
use crate::frame::validate::tx_frame;
use crate::l2::Mac;
use crate::vnet_hdr::VirtioNetHdr;

/// Ethertype of RARP.
pub const ETH_P_RARP: u16 = 0x8035;
/// Bytes of an announce frame: the 42 of a RARP, padded to Ethernet's minimum.
pub const RARP_LEN: usize = 60;

/// The frame QEMU itself sends to announce a guest (`announce_self_create`): a RARP
/// "reverse request" broadcast from `mac`, naming `mac` as sender and target.
pub fn rarp_frame(mac: Mac) -> [u8; RARP_LEN] {
    let mut f = [0u8; RARP_LEN];
    f[..6].fill(0xff);
    f[6..12].copy_from_slice(&mac.0);
    f[12..14].copy_from_slice(&ETH_P_RARP.to_be_bytes());
    f[14..16].copy_from_slice(&1u16.to_be_bytes()); // hardware: Ethernet
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes()); // protocol: IPv4
    f[18] = 6; // hardware address length
    f[19] = 4; // protocol address length
    f[20..22].copy_from_slice(&3u16.to_be_bytes()); // reverse request
    f[22..28].copy_from_slice(&mac.0); // sender hardware address
    f[32..38].copy_from_slice(&mac.0); // target hardware address
    f
}

/// Sends the announce of `mac` into the switch from `port`: learned there like any
/// frame the guest sends (port security, pinned addresses and the move hold apply),
/// then flooded in the port's VLAN.
pub fn announce(port: &Port, switch: &Switch, mac: Mac) {
    let bytes = rarp_frame(mac);
    let parts = [&bytes[..]];
    let frame = match tx_frame(Caps::default(), VirtioNetHdr::default(), &parts) {
        Ok(f) => f,
        Err(reason) => return port.stats.drop(reason),
    };
    if let Some(quiet) = port.log.allow() {
        info!(port = %port.name(), mac = %mac, suppressed = quiet, "announcing the guest (SEND_RARP)");
    }
    let mut ctx = DeliverCtx::default();
    switch.forward(Endpoint::Port(port.id), 0, &frame, &mut ctx);
    ctx.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use etherparse::{ArpOperation, SlicedPacket};

    #[test]
    fn the_announce_is_qemus_rarp() {
        let mac = Mac([0x52, 0x54, 0, 0x12, 0x34, 0x56]);
        let f = rarp_frame(mac);
        let p = SlicedPacket::from_ethernet(&f).unwrap();
        let Some(etherparse::LinkSlice::Ethernet2(eth)) = p.link else {
            panic!("not Ethernet II");
        };
        assert_eq!(eth.destination(), [0xff; 6]);
        assert_eq!(eth.source(), mac.0);
        assert_eq!(eth.ether_type().0, ETH_P_RARP);
        // etherparse reads ARP only under its own ethertype; the body is the same.
        let mut as_arp = f;
        as_arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
        let p = SlicedPacket::from_ethernet(&as_arp).unwrap();
        let Some(etherparse::NetSlice::Arp(arp)) = p.net else {
            panic!("no ARP body");
        };
        assert_eq!(arp.operation(), ArpOperation(3));
        assert_eq!(arp.sender_hw_addr(), mac.0);
        assert_eq!(arp.target_hw_addr(), mac.0);
        assert_eq!(arp.sender_protocol_addr(), [0; 4]);
    }
}
