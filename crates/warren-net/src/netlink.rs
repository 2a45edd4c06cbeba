//! The few rtnetlink requests the plumbing needs, written out by hand:
//! make a veth pair with one end in another network namespace, set links
//! up, add an address and a default route (IPv4 or IPv6), delete and list
//! links.
//!
//! A netlink socket acts in the network namespace it was made in, so
//! [`in_netns`] runs a closure on a thread that has joined the sandbox's.

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use std::os::fd::FromRawFd;

use rustix::net::{recv, send, RecvFlags, SendFlags};

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_DUMP: u16 = 0x300;

const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const NLA_F_NESTED: u16 = 0x8000;

const IFF_UP: u32 = 0x1;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// No duplicate address detection: the veth has one peer, and a tentative
/// address would refuse the sandbox's first connections.
const IFA_F_NODAD: u8 = 0x02;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RTN_UNICAST: u8 = 1;

/// A netlink route socket in the calling thread's network namespace.
pub struct Netlink {
    fd: OwnedFd,
    seq: u32,
}

/// A request under construction: header, fixed part, attributes.
struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Msg {
    fn new(kind: u16, flags: u16) -> Msg {
        let mut buf = vec![0u8; 16];
        buf[4..6].copy_from_slice(&kind.to_ne_bytes());
        buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        Msg { buf, nests: Vec::new() }
    }

    fn raw(&mut self, bytes: &[u8]) -> &mut Msg {
        self.buf.extend_from_slice(bytes);
        self.pad();
        self
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn attr(&mut self, kind: u16, value: &[u8]) -> &mut Msg {
        let len = (4 + value.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.pad();
        self
    }

    fn name(&mut self, kind: u16, name: &str) -> &mut Msg {
        let mut value = name.as_bytes().to_vec();
        value.push(0);
        self.attr(kind, &value)
    }

    fn begin(&mut self, kind: u16) -> &mut Msg {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&[0, 0]);
        self.buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    fn end(&mut self) -> &mut Msg {
        if let Some(start) = self.nests.pop() {
            let len = (self.buf.len() - start) as u16;
            self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    fn finish(&mut self, seq: u32) -> &[u8] {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        &self.buf
    }
}

/// `struct ifinfomsg` with an index and flags.
fn ifinfo(index: i32, flags: u32, change: u32) -> [u8; 16] {
    let mut m = [0u8; 16];
    m[4..8].copy_from_slice(&index.to_ne_bytes());
    m[8..12].copy_from_slice(&flags.to_ne_bytes());
    m[12..16].copy_from_slice(&change.to_ne_bytes());
    m
}

impl Netlink {
    pub fn open() -> io::Result<Netlink> {
        // SAFETY: plain socket(2); a non-negative result is a new fd we own.
        let raw = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Netlink { fd, seq: 0 })
    }

    /// Sends `msg` and waits for the kernel's acknowledgement.
    fn request(&mut self, msg: &mut Msg) -> io::Result<()> {
        self.seq += 1;
        let seq = self.seq;
        send(&self.fd, msg.finish(seq), SendFlags::empty())?;
        let mut buf = vec![0u8; 8192];
        loop {
            let (n, _) = recv(&self.fd, &mut buf, RecvFlags::empty())?;
            for (kind, msg_seq, body) in messages(&buf[..n]) {
                if kind == NLMSG_ERROR && msg_seq == seq && body.len() >= 4 {
                    let errno = i32::from_ne_bytes([body[0], body[1], body[2], body[3]]);
                    return if errno == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(-errno)) };
                }
            }
        }
    }

    /// Makes veth pair `host` <-> `peer`, with `peer` created directly in
    /// the network namespace `netns`.
    pub fn add_veth(&mut self, host: &str, peer: &str, netns: BorrowedFd<'_>) -> io::Result<()> {
        let mut msg = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
        msg.raw(&ifinfo(0, 0, 0)).name(IFLA_IFNAME, host);
        msg.begin(IFLA_LINKINFO).name(IFLA_INFO_KIND, "veth").begin(IFLA_INFO_DATA).begin(VETH_INFO_PEER);
        msg.raw(&ifinfo(0, 0, 0)).name(IFLA_IFNAME, peer);
        msg.attr(IFLA_NET_NS_FD, &(netns.as_raw_fd() as u32).to_ne_bytes());
        msg.end().end().end();
        self.request(&mut msg)
    }

    pub fn set_up(&mut self, name: &str) -> io::Result<()> {
        let index = index_of(name)?;
        let mut msg = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK);
        msg.raw(&ifinfo(index, IFF_UP, IFF_UP));
        self.request(&mut msg)
    }

    pub fn add_address(&mut self, name: &str, addr: IpAddr, prefix_len: u8) -> io::Result<()> {
        let index = index_of(name)?;
        let mut msg = Msg::new(RTM_NEWADDR, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
        let (family, flags, octets) = match addr {
            IpAddr::V4(a) => (AF_INET, 0, a.octets().to_vec()),
            IpAddr::V6(a) => (AF_INET6, IFA_F_NODAD, a.octets().to_vec()),
        };
        let mut ifa = [0u8; 8];
        ifa[0] = family;
        ifa[1] = prefix_len;
        ifa[2] = flags;
        ifa[4..8].copy_from_slice(&(index as u32).to_ne_bytes());
        msg.raw(&ifa).attr(IFA_LOCAL, &octets).attr(IFA_ADDRESS, &octets);
        self.request(&mut msg)
    }

    /// A default route of `gateway`'s family through link `name`.
    pub fn add_default_route(&mut self, name: &str, gateway: IpAddr) -> io::Result<()> {
        let index = index_of(name)?;
        let mut msg = Msg::new(RTM_NEWROUTE, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
        let (family, octets) = match gateway {
            IpAddr::V4(a) => (AF_INET, a.octets().to_vec()),
            IpAddr::V6(a) => (AF_INET6, a.octets().to_vec()),
        };
        let rtm = [family, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, 0, RTN_UNICAST, 0, 0, 0, 0];
        msg.raw(&rtm).attr(RTA_GATEWAY, &octets).attr(RTA_OIF, &(index as u32).to_ne_bytes());
        self.request(&mut msg)
    }

    /// Deletes link `name`; a link that is not there is not an error.
    pub fn delete_link(&mut self, name: &str) -> io::Result<()> {
        let mut msg = Msg::new(RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK);
        msg.raw(&ifinfo(0, 0, 0)).name(IFLA_IFNAME, name);
        match self.request(&mut msg) {
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
            other => other,
        }
    }

    /// The names of every link in this namespace.
    pub fn link_names(&mut self) -> io::Result<Vec<String>> {
        self.seq += 1;
        let seq = self.seq;
        let mut msg = Msg::new(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP);
        msg.raw(&ifinfo(0, 0, 0));
        send(&self.fd, msg.finish(seq), SendFlags::empty())?;
        let mut names = Vec::new();
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            let (n, _) = recv(&self.fd, &mut buf, RecvFlags::empty())?;
            for (kind, msg_seq, body) in messages(&buf[..n]) {
                if msg_seq != seq {
                    continue;
                }
                match kind {
                    NLMSG_DONE => return Ok(names),
                    NLMSG_ERROR => {
                        let errno = body.get(..4).map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                        return Err(io::Error::from_raw_os_error(-errno));
                    }
                    RTM_NEWLINK => {
                        if let Some(name) =
                            attrs(body.get(16..).unwrap_or_default()).find(|(kind, _)| *kind == IFLA_IFNAME).map(
                                |(_, v)| String::from_utf8_lossy(v.split(|&b| b == 0).next().unwrap_or(v)).into_owned(),
                            )
                        {
                            names.push(name);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Splits a datagram into (type, seq, body) of each message.
fn messages(mut data: &[u8]) -> impl Iterator<Item = (u16, u32, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < 16 {
            return None;
        }
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        if len < 16 || len > data.len() {
            return None;
        }
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        let seq = u32::from_ne_bytes([data[8], data[9], data[10], data[11]]);
        let body = &data[16..len];
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some((kind, seq, body))
    })
}

/// Splits a run of attributes into (type, value).
fn attrs(mut data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([data[0], data[1]]) as usize;
        if len < 4 || len > data.len() {
            return None;
        }
        let kind = u16::from_ne_bytes([data[2], data[3]]) & !NLA_F_NESTED;
        let value = &data[4..len];
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some((kind, value))
    })
}

fn index_of(name: &str) -> io::Result<i32> {
    let cname = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is a valid NUL-terminated string for the call's duration.
    let index = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if index == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(index as i32)
}

/// Runs `f` on a new thread that has joined the network namespace `netns`
/// (the thread ends with `f`, so no other code ever runs in it).
pub fn in_netns<T: Send + 'static>(
    netns: OwnedFd,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    std::thread::Builder::new()
        .name("warren-net-ns".into())
        .spawn(move || {
            rustix::thread::move_into_link_name_space(netns.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))?;
            f()
        })?
        .join()
        .map_err(|_| io::Error::other("the netns thread panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_get_their_lengths() {
        let mut msg = Msg::new(RTM_NEWLINK, NLM_F_REQUEST);
        msg.begin(IFLA_LINKINFO).name(IFLA_INFO_KIND, "veth").end();
        let bytes = msg.finish(7).to_vec();
        assert_eq!(u32::from_ne_bytes(bytes[0..4].try_into().unwrap()) as usize, bytes.len());
        let outer: Vec<_> = attrs(&bytes[16..]).collect();
        assert_eq!(outer.len(), 1);
        assert_eq!(outer[0].0, IFLA_LINKINFO);
        let inner: Vec<_> = attrs(outer[0].1).collect();
        assert_eq!(inner, vec![(IFLA_INFO_KIND, &b"veth\0"[..])]);
    }
}
