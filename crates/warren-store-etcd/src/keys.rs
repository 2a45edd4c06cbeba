use warren_store::Table;

use crate::error::EtcdError;

/// The key layout: `<prefix>/<table>/<key>`. Table names contain no `/`, so
/// one table's range never holds another's keys, and etcd's byte order
/// within a table is the trait's key order.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Result<Self, EtcdError> {
        let trimmed = prefix.trim_end_matches('/');
        if !trimmed.starts_with('/') || trimmed.contains("//") {
            return Err(EtcdError::Config(format!(
                "etcd key prefix {prefix:?} must be an absolute path like /warren (no empty segments)"
            )));
        }
        Ok(Self { prefix: trimmed.to_owned() })
    }

    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `<prefix>/<table>/`: what every key of the table starts with.
    pub(crate) fn table(&self, t: Table) -> Vec<u8> {
        format!("{}/{}/", self.prefix, t.name()).into_bytes()
    }

    pub(crate) fn key(&self, t: Table, key: &str) -> Vec<u8> {
        let mut full = self.table(t);
        full.extend_from_slice(key.as_bytes());
        full
    }

    /// `[start, end)` covering every key of `t` that starts with `prefix`.
    pub(crate) fn range(&self, t: Table, prefix: &str) -> (Vec<u8>, Vec<u8>) {
        let start = self.key(t, prefix);
        let end = prefix_end(&start);
        (start, end)
    }

    /// The trait's key for a full etcd key of table `t`.
    pub(crate) fn strip(&self, t: Table, full: &[u8]) -> Result<String, EtcdError> {
        let table = self.table(t);
        let rest = full.strip_prefix(table.as_slice()).ok_or_else(|| EtcdError::ForeignKey(full.to_vec()))?;
        String::from_utf8(rest.to_vec()).map_err(|_| EtcdError::ForeignKey(full.to_vec()))
    }
}

/// The least key greater than every key starting with `start`. `start`
/// always holds a `/` and is UTF-8, in which no byte is 0xff, so bumping the
/// last byte is enough.
fn prefix_end(start: &[u8]) -> Vec<u8> {
    let mut end = start.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Unreachable for our keys; `\0` is etcd's "to the end of the keyspace".
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_prefix_table_key() {
        let keys = Keys::new("/warren/").unwrap();
        assert_eq!(keys.key(Table::Sandboxes, "sb-1"), b"/warren/sandboxes/sb-1");
        assert_eq!(keys.strip(Table::Sandboxes, b"/warren/sandboxes/sb-1").unwrap(), "sb-1");
        assert!(matches!(keys.strip(Table::Execs, b"/warren/sandboxes/sb-1"), Err(EtcdError::ForeignKey(_))));
        let (start, end) = keys.range(Table::Execs, "a/");
        assert_eq!((start.as_slice(), end.as_slice()), (&b"/warren/execs/a/"[..], &b"/warren/execs/a0"[..]));
    }

    #[test]
    fn prefix_must_be_an_absolute_path() {
        for bad in ["", "warren", "/a//b", "//"] {
            assert!(matches!(Keys::new(bad), Err(EtcdError::Config(_))), "{bad:?} accepted");
        }
        assert_eq!(Keys::new("/a/b").unwrap().prefix(), "/a/b");
    }
}
