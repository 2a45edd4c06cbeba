//! The platform resolver's wire format: a minimal DNS message parser and
//! answer writer (one question, A/AAAA answers, REFUSED), and the static
//! hosts map (`/etc/hosts` format) it answers from before asking the host.

use std::collections::BTreeMap;
use std::net::IpAddr;

pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
const CLASS_IN: u16 = 1;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_REFUSED: u8 = 5;
/// Answers are pinned into the policy for as long as the sandbox lives;
/// the TTL only tells the client when to ask again.
const ANSWER_TTL_SECS: u32 = 60;
const MAX_NAME_BYTES: usize = 253;

/// The question of a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    /// Recursion desired, echoed in the answer.
    rd: bool,
    /// Lower-case, without the trailing dot.
    pub name: String,
    pub qtype: u16,
    /// The raw question section, echoed in the answer.
    question: Vec<u8>,
}

/// Parses a query with exactly one question; `None` for anything else
/// (answers, compressed or oversized names, truncated messages).
pub fn parse_query(msg: &[u8]) -> Option<Query> {
    if msg.len() < 12 {
        return None;
    }
    let id = u16::from_be_bytes([msg[0], msg[1]]);
    let flags = u16::from_be_bytes([msg[2], msg[3]]);
    let qdcount = u16::from_be_bytes([msg[4], msg[5]]);
    if flags & 0x8000 != 0 || (flags >> 11) & 0xf != 0 || qdcount != 1 {
        return None;
    }
    let mut pos = 12;
    let mut labels = Vec::new();
    loop {
        let len = *msg.get(pos)? as usize;
        pos += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        let label = msg.get(pos..pos + len)?;
        labels.push(String::from_utf8(label.to_ascii_lowercase()).ok()?);
        pos += len;
    }
    let name = labels.join(".");
    if name.len() > MAX_NAME_BYTES {
        return None;
    }
    let qtype = u16::from_be_bytes([*msg.get(pos)?, *msg.get(pos + 1)?]);
    let qclass = u16::from_be_bytes([*msg.get(pos + 2)?, *msg.get(pos + 3)?]);
    if qclass != CLASS_IN {
        return None;
    }
    Some(Query { id, rd: flags & 0x0100 != 0, name, qtype, question: msg[12..pos + 4].to_vec() })
}

/// The id of any message, to answer FORMERR to what cannot be parsed.
pub fn message_id(msg: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes([*msg.first()?, *msg.get(1)?]))
}

/// An answer to `query` with `rcode` and, for NOERROR, the addresses of
/// the query's type.
pub fn answer(query: &Query, rcode: u8, addrs: &[IpAddr]) -> Vec<u8> {
    let records: Vec<&IpAddr> = addrs
        .iter()
        .filter(|a| match query.qtype {
            TYPE_A => a.is_ipv4(),
            TYPE_AAAA => a.is_ipv6(),
            _ => false,
        })
        .collect();
    let records = if rcode == 0 { records } else { Vec::new() };
    let flags: u16 = 0x8000 | 0x0400 | if query.rd { 0x0100 } else { 0 } | 0x0080 | u16::from(rcode);
    let mut out = Vec::with_capacity(12 + query.question.len() + records.len() * 28);
    out.extend_from_slice(&query.id.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(records.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&query.question);
    for addr in records {
        out.extend_from_slice(&[0xc0, 0x0c]);
        let (kind, data) = match addr {
            IpAddr::V4(v4) => (TYPE_A, v4.octets().to_vec()),
            IpAddr::V6(v6) => (TYPE_AAAA, v6.octets().to_vec()),
        };
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ANSWER_TTL_SECS.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(&data);
    }
    out
}

/// A bare error answer for a message that could not be parsed.
pub fn error_answer(id: u16, rcode: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&(0x8080u16 | u16::from(rcode)).to_be_bytes());
    out.extend_from_slice(&[0; 8]);
    out
}

/// Whether `name` matches a domain rule's pattern: exactly, or for
/// `*.suffix` any name below `suffix` (not `suffix` itself).
pub fn matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => {
            name.len() > suffix.len() + 1 && name.ends_with(suffix) && name.ends_with(&format!(".{suffix}"))
        }
        None => pattern == name,
    }
}

/// Parses `/etc/hosts`-format text: `ADDRESS NAME [ALIAS...]`, `#` comments.
pub fn parse_hosts(text: &str) -> Result<BTreeMap<String, Vec<IpAddr>>, String> {
    let mut hosts: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let addr = words.next().unwrap_or_default();
        let addr: IpAddr = addr.parse().map_err(|_| format!("line {}: {addr:?} is not an IP address", i + 1))?;
        for name in words {
            let list = hosts.entry(name.trim_end_matches('.').to_ascii_lowercase()).or_default();
            if !list.contains(&addr) {
                list.push(addr);
            }
        }
    }
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&CLASS_IN.to_be_bytes());
        q
    }

    #[test]
    fn a_query_is_parsed_and_answered() {
        let q = parse_query(&query("Pypi.ORG", TYPE_A)).unwrap();
        assert_eq!((q.id, q.name.as_str(), q.qtype), (0x1234, "pypi.org", TYPE_A));
        let addrs = ["10.1.2.3".parse().unwrap(), "fd00::1".parse().unwrap()];
        let a = answer(&q, 0, &addrs);
        assert_eq!(u16::from_be_bytes([a[6], a[7]]), 1, "one A record, the AAAA one is left out");
        assert_eq!(&a[a.len() - 4..], &[10, 1, 2, 3]);
        assert_eq!(a[3] & 0xf, 0);
        let refused = answer(&q, RCODE_REFUSED, &addrs);
        assert_eq!((refused[3] & 0xf, u16::from_be_bytes([refused[6], refused[7]])), (RCODE_REFUSED, 0));
    }

    #[test]
    fn malformed_queries_are_rejected() {
        assert!(parse_query(&[0; 5]).is_none());
        let mut truncated = query("example.com", TYPE_A);
        truncated.truncate(truncated.len() - 3);
        assert!(parse_query(&truncated).is_none());
        let mut compressed = query("example.com", TYPE_A);
        compressed[12] = 0xc0;
        assert!(parse_query(&compressed).is_none());
    }

    #[test]
    fn wildcards_match_below_their_suffix_only() {
        assert!(matches("pypi.org", "pypi.org"));
        assert!(!matches("pypi.org", "evil.pypi.org"));
        assert!(matches("*.pythonhosted.org", "files.pythonhosted.org"));
        assert!(!matches("*.pythonhosted.org", "pythonhosted.org"));
        assert!(!matches("*.pythonhosted.org", "evilpythonhosted.org"));
    }

    #[test]
    fn hosts_files_parse() {
        let hosts = parse_hosts("# c\n10.0.0.1 a.test b.test\n\nfd00::2 a.test # v6\n").unwrap();
        assert_eq!(hosts["a.test"].len(), 2);
        assert_eq!(hosts["b.test"], vec!["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert!(parse_hosts("nonsense name").is_err());
    }
}
