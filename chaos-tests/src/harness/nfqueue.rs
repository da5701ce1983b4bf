//! The one module of troupe-chaos with unsafe code: a netfilter queue (NFQUEUE) client over raw
//! netlink, and a raw IPv4 socket that sends duplicate packets. Only what the link nemesis needs: move a
//! thread into a network namespace, bind a queue there, read the queued packets' ids (and bytes, when
//! asked), and give each its verdict — later, in any order.
//!
//! Why not the `nfq` crate: it hides its socket, so a thread cannot wait for packets and for the next
//! release time at once (only busy polling), and every held packet pins a whole receive buffer.
//!
//! The wire format is nfnetlink_queue's (linux/netfilter/nfnetlink_queue.h): a `nlmsghdr`, a `nfgenmsg`
//! whose `res_id` is the queue number (big-endian), then attributes (`nlattr`, 4-byte aligned).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// One packet the kernel queued: its id, and its bytes (the IP packet) when the queue copies them.
#[derive(Debug)]
pub struct Packet {
    pub id: u32,
    pub payload: Vec<u8>,
}

const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_PARAMS: u16 = 2;
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;

fn last_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn check(ret: libc::c_int, what: &str) -> io::Result<()> {
    if ret < 0 {
        return Err(last_error(what));
    }
    Ok(())
}

fn set_int_option(
    fd: &OwnedFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
    what: &str,
) -> io::Result<()> {
    // SAFETY: a valid socket and a pointer to an int of the size passed.
    let ret = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    check(ret, what)
}

/// Moves the calling thread (only it) into the network namespace `ns` that `ip netns add` created:
/// sockets it opens from then on live there.
pub fn enter_netns(ns: &str) -> io::Result<()> {
    let path = format!("/run/netns/{ns}");
    let file = File::open(&path).map_err(|e| io::Error::new(e.kind(), format!("opening {path}: {e}")))?;
    // SAFETY: setns on a namespace file we hold open; a network namespace may be entered by one thread of
    // a multi-threaded process.
    check(unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) }, "setns(CLONE_NEWNET)")
}

/// A bound netfilter queue in the calling thread's network namespace.
pub struct QueueSocket {
    fd: OwnedFd,
    queue: u16,
    copy_packets: bool,
    buf: Vec<u8>,
    /// Packets read while waiting for a configuration acknowledgement.
    early: Vec<Packet>,
}

impl QueueSocket {
    /// Binds queue `queue` (it must be unbound in this namespace) holding at most `max_len` packets;
    /// `copy_packets`: the packets' bytes come with them (for duplicates), else only their ids.
    pub fn bind(queue: u16, copy_packets: bool, max_len: u32) -> io::Result<Self> {
        // SAFETY: plain socket(2); the fd is owned at once.
        let raw =
            unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_NETFILTER) };
        check(raw, "socket(AF_NETLINK, NETLINK_NETFILTER)")?;
        // SAFETY: `raw` is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a zeroed sockaddr_nl is valid; nl_pid 0 lets the kernel pick the port id.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: a valid socket and address of the size passed.
        let ret = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        check(ret, "bind(netlink)")?;
        // Bursts must not overflow the socket (the kernel then drops what it cannot queue to us).
        set_int_option(&fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 16 << 20, "SO_RCVBUFFORCE")?;
        set_int_option(&fd, libc::SOL_NETLINK, libc::NETLINK_NO_ENOBUFS, 1, "NETLINK_NO_ENOBUFS")?;
        let mut socket = QueueSocket { fd, queue, copy_packets, buf: vec![0; 256 << 10], early: Vec::new() };
        let cmd = [libc::NFQNL_CFG_CMD_BIND as u8, 0, 0, 0]; // command, pad, pf (unused since 3.8)
        socket.configure(libc::NFQA_CFG_CMD as u16, &cmd, "binding the queue")?;
        let (range, mode): (u32, u8) =
            if copy_packets { (0xffff, libc::NFQNL_COPY_PACKET as u8) } else { (0, libc::NFQNL_COPY_META as u8) };
        let mut params = range.to_be_bytes().to_vec();
        params.push(mode);
        socket.configure(NFQA_CFG_PARAMS, &params, "setting the copy mode")?;
        socket.configure(libc::NFQA_CFG_QUEUE_MAXLEN as u16, &max_len.to_be_bytes(), "setting the queue length")?;
        Ok(socket)
    }

    /// A nfnetlink_queue message of `kind` carrying `attrs`.
    fn message(&self, kind: libc::c_int, flags: libc::c_int, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut m = vec![0u8; NLMSG_HDRLEN];
        m.extend([libc::AF_UNSPEC as u8, libc::NFNETLINK_V0 as u8]);
        m.extend(self.queue.to_be_bytes());
        for (kind, data) in attrs {
            m.extend(((4 + data.len()) as u16).to_ne_bytes());
            m.extend(kind.to_ne_bytes());
            m.extend_from_slice(data);
            m.resize(m.len().next_multiple_of(4), 0);
        }
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&(((libc::NFNL_SUBSYS_QUEUE << 8) | kind) as u16).to_ne_bytes());
        m[6..8].copy_from_slice(&((libc::NLM_F_REQUEST | flags) as u16).to_ne_bytes());
        m
    }

    fn send(&self, message: &[u8], what: &str) -> io::Result<()> {
        // SAFETY: a valid socket and a buffer of the length passed; the kernel is the default destination.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), message.as_ptr().cast(), message.len(), 0) };
        if n < 0 {
            return Err(last_error(what));
        }
        Ok(())
    }

    /// Sends a configuration attribute and waits for the kernel's acknowledgement.
    fn configure(&mut self, attr: u16, data: &[u8], what: &str) -> io::Result<()> {
        let m = self.message(libc::NFQNL_MSG_CONFIG, libc::NLM_F_ACK, &[(attr, data)]);
        self.send(&m, what)?;
        loop {
            let mut packets = Vec::new();
            if let Some(errno) = self.read(0, &mut packets)? {
                self.early.append(&mut packets);
                if errno == 0 {
                    return Ok(());
                }
                let e = io::Error::from_raw_os_error(errno);
                return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
            }
            self.early.append(&mut packets);
        }
    }

    /// Waits up to `timeout_ms` for packets, then reads every packet queued by now into `out`.
    pub fn recv(&mut self, timeout_ms: i32, out: &mut Vec<Packet>) -> io::Result<()> {
        out.append(&mut self.early);
        let mut poll = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut poll, 1, timeout_ms) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(()) } else { Err(e) };
        }
        // Bounded, so that a flood cannot starve the releases of held packets.
        for _ in 0..if ready > 0 { 64 } else { 0 } {
            match self.read(libc::MSG_DONTWAIT, out) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // The socket overflowed: those packets are gone (a loss QUIC recovers from).
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads one datagram: packets go to `out`; an acknowledgement or error is returned as its errno.
    fn read(&mut self, flags: libc::c_int, out: &mut Vec<Packet>) -> io::Result<Option<i32>> {
        // SAFETY: a valid socket and a buffer of the length passed.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), self.buf.as_mut_ptr().cast(), self.buf.len(), flags) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut ack = None;
        let mut rest = &self.buf[..n as usize];
        while rest.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
            if len < NLMSG_HDRLEN || len > rest.len() {
                break;
            }
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            let body = &rest[NLMSG_HDRLEN..len];
            match kind {
                NLMSG_ERROR if body.len() >= 4 => {
                    ack = Some(-i32::from_ne_bytes(body[0..4].try_into().expect("4 bytes")));
                }
                NLMSG_DONE => {}
                k if k == ((libc::NFNL_SUBSYS_QUEUE << 8) | libc::NFQNL_MSG_PACKET) as u16 => {
                    if let Some(p) = parse_packet(body, self.copy_packets) {
                        out.push(p);
                    }
                }
                _ => {}
            }
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        }
        Ok(ack)
    }

    /// Lets packet `id` go on (`accept`) or drops it.
    pub fn verdict(&self, id: u32, accept: bool) -> io::Result<()> {
        let mut hdr = (if accept { NF_ACCEPT } else { NF_DROP }).to_be_bytes().to_vec();
        hdr.extend(id.to_be_bytes());
        let m = self.message(libc::NFQNL_MSG_VERDICT, 0, &[(NFQA_VERDICT_HDR, &hdr)]);
        self.send(&m, "sending a verdict")
    }
}

/// A queued packet's id and, when copied, its bytes.
fn parse_packet(body: &[u8], copy: bool) -> Option<Packet> {
    let mut attrs = body.get(NFGENMSG_LEN..)?;
    let (mut id, mut payload) = (None, Vec::new());
    while attrs.len() >= 4 {
        let len = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
        if len < 4 || len > attrs.len() {
            break;
        }
        let data = &attrs[4..len];
        if kind == NFQA_PACKET_HDR && data.len() >= 4 {
            id = Some(u32::from_be_bytes(data[0..4].try_into().expect("4 bytes")));
        } else if kind == libc::NFQA_PAYLOAD as u16 && copy {
            payload = data.to_vec();
        }
        attrs = &attrs[len.next_multiple_of(4).min(attrs.len())..];
    }
    Some(Packet { id: id?, payload })
}

/// A raw IPv4 socket that sends whole IP packets (the kernel fills in the header checksum), with a
/// firewall mark so that the queue's rule lets them pass instead of queueing them again.
pub struct RawSender(OwnedFd);

impl RawSender {
    pub fn open(mark: u32) -> io::Result<Self> {
        // SAFETY: plain socket(2); IPPROTO_RAW implies IP_HDRINCL.
        let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::IPPROTO_RAW) };
        check(raw, "socket(AF_INET, SOCK_RAW)")?;
        // SAFETY: `raw` is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        set_int_option(&fd, libc::SOL_SOCKET, libc::SO_MARK, mark as libc::c_int, "SO_MARK")?;
        Ok(RawSender(fd))
    }

    /// Sends `packet` (a whole IPv4 packet) to its destination address.
    pub fn send(&self, packet: &[u8]) -> io::Result<()> {
        let Some(dst) = packet.get(16..20) else { return Ok(()) };
        // SAFETY: a zeroed sockaddr_in is valid.
        let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from_ne_bytes(dst.try_into().expect("4 bytes"));
        // SAFETY: a valid socket, a buffer and an address of the lengths passed.
        let n = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&addr as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(last_error("sending a duplicate packet"));
        }
        Ok(())
    }
}
