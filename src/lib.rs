//! gsonet: a vhost-user virtio-net backend that negotiates checksum and segmentation
//! offloads with each guest and segments in software only for peers that need it.

pub mod segment;
pub mod vnet_hdr;
