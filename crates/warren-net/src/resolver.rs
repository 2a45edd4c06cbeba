//! The platform resolver of one sandbox: UDP port 53 on its gateway
//! address. It answers A/AAAA only for names a `domain` rule allows, pins
//! the answers into the sandbox's policy before replying, and refuses (and
//! reports) every other name.

use std::net::{IpAddr, SocketAddr};

use tokio::net::UdpSocket;

use crate::dns::{self, Query};
use crate::{Endpoint, Error, NetEvent, NetEventKind, Network, Result};

/// Stops the resolver when dropped.
pub struct Handle(tokio::task::JoinHandle<()>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves sandbox `id` on its gateway; queries from any other address
/// (another sandbox with a broad rule) are ignored, so one sandbox can
/// never pin answers into another's policy.
pub async fn serve(net: Network, id: String, endpoint: Endpoint) -> Result<Handle> {
    let addr = SocketAddr::from((endpoint.gateway, 53));
    let socket = UdpSocket::bind(addr).await.map_err(|e| Error::io(format!("bind the resolver on {addr}"), e))?;
    Ok(Handle(tokio::spawn(async move {
        let mut buf = vec![0u8; 1500];
        loop {
            let (n, peer) = match socket.recv_from(&mut buf).await {
                Ok(got) => got,
                Err(e) => {
                    tracing::warn!(sandbox = %id, "resolver socket: {e}");
                    continue;
                }
            };
            if peer.ip() != IpAddr::V4(endpoint.address) {
                continue;
            }
            let reply = match dns::parse_query(&buf[..n]) {
                Some(query) => answer(&net, &id, &query).await,
                None => match dns::message_id(&buf[..n]) {
                    Some(msg_id) => dns::error_answer(msg_id, dns::RCODE_FORMERR),
                    None => continue,
                },
            };
            let _ = socket.send_to(&reply, peer).await;
        }
    })))
}

async fn answer(net: &Network, id: &str, query: &Query) -> Vec<u8> {
    if query.qtype != dns::TYPE_A && query.qtype != dns::TYPE_AAAA {
        return dns::answer(query, 0, &[]);
    }
    match net.resolve(id, &query.name).await {
        Ok(Some(addrs)) => dns::answer(query, 0, &addrs),
        Ok(None) => {
            net.report(
                id,
                NetEvent {
                    kind: NetEventKind::DnsRefused,
                    pid: 0,
                    comm: String::new(),
                    syscall: String::new(),
                    detail: format!("{} ({})", query.name, if query.qtype == dns::TYPE_A { "A" } else { "AAAA" }),
                },
            );
            dns::answer(query, dns::RCODE_REFUSED, &[])
        }
        Err(e) => {
            tracing::warn!(sandbox = %id, "resolving {}: {e}", query.name);
            dns::answer(query, dns::RCODE_SERVFAIL, &[])
        }
    }
}
