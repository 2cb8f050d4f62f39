//! Fuzz entry for the vhost-user relay's message framing: an arbitrary byte stream,
//! written in fuzzer-chosen pieces with descriptors attached, read back by the relay's
//! `recv` over a real socketpair and sent on by its `send`.
//!
//! Input layout: 1 byte piece count k (mod 8) | k * 3 bytes (split point u16 LE,
//! descriptors to attach: [0, 1, 3, 33][b % 4]) | the stream (at most `MAX_STREAM`).

use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;

use crate::backend::vhost::relay::framing::{
    recv_message, send_message, HEADER_LEN, MAX_FDS_PER_MSG, MAX_PAYLOAD_LEN,
};
use crate::sys::scm;

/// The stream is cut here: a socketpair's buffer holds it all before it is read.
pub const MAX_STREAM: usize = 32 * 1024;
const FD_COUNTS: [usize; 4] = [0, 1, 3, 33];

/// A descriptor to attach (any open file will do).
fn some_fd() -> BorrowedFd<'static> {
    static FD: OnceLock<OwnedFd> = OnceLock::new();
    FD.get_or_init(|| OwnedFd::from(std::fs::File::open("/dev/null").expect("open /dev/null")))
        .as_fd()
}

/// Encodes a fuzz input: `pieces` are (split point, descriptor code).
pub fn encode(pieces: &[(u16, u8)], stream: &[u8]) -> Vec<u8> {
    let k = pieces.len().min(7);
    let mut v = vec![k as u8];
    for &(at, fds) in &pieces[..k] {
        v.extend_from_slice(&at.to_le_bytes());
        v.push(fds);
    }
    v.extend_from_slice(stream);
    v
}

/// One vhost-user message's bytes.
pub fn message(request: u32, flags: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&request.to_le_bytes());
    v.extend_from_slice(&flags.to_le_bytes());
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// What the framing must make of the stream at `pos`.
enum Expect {
    End,
    Message(usize),
    Truncated,
    TooBig,
}

fn expect(stream: &[u8], pos: usize) -> Expect {
    let rest = stream.len() - pos;
    if rest == 0 {
        return Expect::End;
    }
    if rest < HEADER_LEN {
        return Expect::Truncated;
    }
    let s = &stream[pos + 8..pos + 12];
    let size = u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize;
    if size > MAX_PAYLOAD_LEN {
        Expect::TooBig
    } else if rest - HEADER_LEN < size {
        Expect::Truncated
    } else {
        Expect::Message(size)
    }
}

#[doc(hidden)]
pub fn fuzz_one(data: &[u8]) {
    let Some((&k, rest)) = data.split_first() else {
        return;
    };
    let k = usize::from(k % 8);
    if rest.len() < 3 * k {
        return;
    }
    let (spec, stream) = rest.split_at(3 * k);
    let stream = &stream[..stream.len().min(MAX_STREAM)];
    let mut cuts: Vec<(usize, usize)> = spec
        .chunks_exact(3)
        .map(|c| {
            let at = usize::from(u16::from_le_bytes([c[0], c[1]])) % (stream.len() + 1);
            (at, FD_COUNTS[usize::from(c[2] % 4)])
        })
        .collect();
    cuts.sort_unstable();

    let (writer, mut reader) = UnixStream::pair().expect("socketpair");
    let (fwd_w, mut fwd_r) = UnixStream::pair().expect("socketpair");
    // Write every piece, each with its descriptors on its first byte.
    let mut at = 0;
    let mut sent_fds = 0usize;
    let mut too_many_fds = false;
    let ends = cuts
        .iter()
        .map(|&(c, _)| c)
        .chain(std::iter::once(stream.len()));
    let fd_counts = std::iter::once(0).chain(cuts.iter().map(|&(_, n)| n));
    for (end, nfds) in ends.zip(fd_counts) {
        let piece = &stream[at..end];
        if piece.is_empty() {
            continue;
        }
        let fds = vec![some_fd(); nfds];
        let n = scm::send_with_fds(&writer, piece, &fds).expect("send piece");
        std::io::Write::write_all(&mut &writer, &piece[n..]).expect("write piece");
        sent_fds += nfds;
        too_many_fds |= nfds > MAX_FDS_PER_MSG;
        at = end;
    }
    drop(writer);

    let mut pos = 0;
    let mut got_fds = 0usize;
    loop {
        let want = expect(stream, pos);
        let r = recv_message(&mut reader);
        let m = match (want, r) {
            (Expect::End, Ok(None)) => break,
            (Expect::Message(size), Ok(Some(m))) => {
                assert_eq!(&m.hdr[..], &stream[pos..pos + HEADER_LEN], "header");
                let body = &stream[pos + HEADER_LEN..pos + HEADER_LEN + size];
                assert!(m.payload == body, "payload is not the stream's next bytes");
                assert!(m.fds.len() <= MAX_FDS_PER_MSG);
                got_fds += m.fds.len();
                assert!(got_fds <= sent_fds, "more descriptors than were sent");
                pos += HEADER_LEN + size;
                m
            }
            (Expect::TooBig, Err(e)) if e.kind() == ErrorKind::InvalidData => break,
            (Expect::Truncated, Err(e)) if e.kind() == ErrorKind::UnexpectedEof => break,
            // More descriptors than a message may carry: refused, connection over.
            (_, Err(_)) if too_many_fds => break,
            (_, Ok(Some(m))) if too_many_fds => {
                // The refusal may come later; what arrives must still be the stream.
                assert_eq!(&m.hdr[..], &stream[pos..pos + HEADER_LEN]);
                pos += HEADER_LEN + m.payload.len();
                m
            }
            (w, r) => panic!(
                "at byte {pos}: expected {}, got {:?}",
                match w {
                    Expect::End => "end of stream".to_string(),
                    Expect::Message(n) => format!("a message of {n} bytes"),
                    Expect::Truncated => "a truncated message".into(),
                    Expect::TooBig => "an oversized payload".into(),
                },
                r.map(|o| o.map(|m| (m.hdr, m.payload.len(), m.fds.len())))
            ),
        };
        // What the relay sends on is what it read, descriptors included.
        let (hdr, payload, nfds) = (m.hdr, m.payload.clone(), m.fds.len());
        send_message(&fwd_w, m).expect("send on");
        let again = recv_message(&mut fwd_r)
            .expect("read back")
            .expect("a message");
        assert_eq!(again.hdr, hdr);
        assert!(again.payload == payload);
        assert_eq!(again.fds.len(), nfds);
    }
}

fn seeds() -> Vec<Vec<u8>> {
    let mut two = message(1, 1, &[]);
    two.extend(message(2, 1, &[1, 2, 3, 4, 5, 6, 7, 8]));
    let mut mem = message(5, 1, &[0x11; 0x28 + 8]);
    mem.extend(message(18, 9, &[1, 0, 0, 0, 1, 0, 0, 0]));
    let mut over = message(3, 1, &[]);
    over.extend_from_slice(&u32::MAX.to_le_bytes());
    vec![
        encode(&[], &two),
        encode(&[(5, 1), (12, 0), (13, 2)], &two),
        encode(&[(0, 1), (20, 3)], &mem),
        encode(&[(3, 1)], &mem[..mem.len() - 3]),
        encode(&[], &message(6, 1, &vec![0; MAX_PAYLOAD_LEN + 1])[..40]),
        encode(&[(12, 2)], &over),
        encode(&[(0, 3)], &message(8, 1, &[0; 8])),
        encode(&[], &message(4, 1, &vec![7; MAX_PAYLOAD_LEN])),
    ]
}

/// Writes the seeds into `dir`.
pub fn write_seeds(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    for (i, s) in seeds().iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), s).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::replay;

    #[test]
    fn fuzz_relay_corpus_replays() {
        replay("relay", fuzz_one, 5);
    }

    #[test]
    fn seeds_pass() {
        for s in seeds() {
            fuzz_one(&s);
        }
    }

    /// `cargo test --lib write_relay_fuzz_seeds -- --ignored`.
    #[test]
    #[ignore]
    fn write_relay_fuzz_seeds() {
        write_seeds(&crate::testkit::corpus_dir("relay"));
    }
}
