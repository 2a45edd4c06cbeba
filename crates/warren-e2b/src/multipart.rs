//! A streaming `multipart/form-data` reader, for envd's `POST /files`:
//! parts are read one after another and a part's data is handed out in
//! chunks as it arrives, so an upload is never held in memory whole.

use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Stream, StreamExt};

/// Bound on one part's header block.
const MAX_HEADER_BYTES: usize = 16 << 10;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MultipartError {
    #[error("multipart body: {0}")]
    Malformed(String),
    #[error("the upload broke off: {0}")]
    Body(String),
}

fn malformed(m: impl Into<String>) -> MultipartError {
    MultipartError::Malformed(m.into())
}

/// A part's headers: its form field name and file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub name: Option<String>,
    pub filename: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first delimiter.
    Preamble,
    /// Just after a delimiter: `--` (the end) or a header block follows.
    AfterDelimiter,
    Data,
    Done,
}

pub struct Multipart<S> {
    body: S,
    buf: BytesMut,
    /// `\r\n--<boundary>`: the preamble is given a leading CRLF so that
    /// every delimiter, the first too, has this one shape.
    delimiter: Vec<u8>,
    state: State,
    eof: bool,
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    if !parts.next()?.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parts.find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim().eq_ignore_ascii_case("boundary").then(|| v.trim().trim_matches('"').to_string())
    })
}

impl<S, E> Multipart<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    pub fn new(body: S, boundary: &str) -> Self {
        let mut buf = BytesMut::new();
        buf.extend_from_slice(b"\r\n");
        Multipart { body, buf, delimiter: format!("\r\n--{boundary}").into_bytes(), state: State::Preamble, eof: false }
    }

    /// Pulls one more chunk of the body into the buffer; false at its end.
    async fn fill(&mut self) -> Result<bool, MultipartError> {
        if self.eof {
            return Ok(false);
        }
        match self.body.next().await {
            Some(Ok(chunk)) => {
                self.buf.extend_from_slice(&chunk);
                Ok(true)
            }
            Some(Err(e)) => Err(MultipartError::Body(e.to_string())),
            None => {
                self.eof = true;
                Ok(false)
            }
        }
    }

    fn find(&self, needle: &[u8]) -> Option<usize> {
        self.buf.windows(needle.len()).position(|w| w == needle)
    }

    /// The next part's headers, or `None` after the last part. Data of the
    /// current part that was not read is skipped.
    pub async fn next_part(&mut self) -> Result<Option<Part>, MultipartError> {
        loop {
            match self.state {
                State::Done => return Ok(None),
                State::Data => while self.read_chunk().await?.is_some() {},
                State::Preamble => match self.find(&self.delimiter.clone()) {
                    Some(i) => {
                        self.buf.advance(i + self.delimiter.len());
                        self.state = State::AfterDelimiter;
                    }
                    None => {
                        // Keep what could be the start of a delimiter.
                        let keep = self.delimiter.len().min(self.buf.len());
                        self.buf.advance(self.buf.len() - keep);
                        if !self.fill().await? {
                            return Err(malformed("no boundary in the body"));
                        }
                    }
                },
                State::AfterDelimiter => {
                    while self.buf.len() < 2 {
                        if !self.fill().await? {
                            return Err(malformed("the body ends right after a boundary"));
                        }
                    }
                    if self.buf.starts_with(b"--") {
                        self.state = State::Done;
                        return Ok(None);
                    }
                    return self.headers().await.map(Some);
                }
            }
        }
    }

    async fn headers(&mut self) -> Result<Part, MultipartError> {
        let end = loop {
            if let Some(i) = self.find(b"\r\n\r\n") {
                break i;
            }
            if self.buf.len() > MAX_HEADER_BYTES {
                return Err(malformed("a part's headers are too long"));
            }
            if !self.fill().await? {
                return Err(malformed("the body ends inside a part's headers"));
            }
        };
        let block = self.buf.split_to(end + 4);
        let text = std::str::from_utf8(&block).map_err(|_| malformed("part headers are not UTF-8"))?;
        let mut part = Part { name: None, filename: None };
        // The first line is the rest of the delimiter line (transport padding).
        for line in text.split("\r\n").skip(1) {
            let Some((k, v)) = line.split_once(':') else { continue };
            if k.trim().eq_ignore_ascii_case("content-disposition") {
                part.name = disposition_param(v, "name");
                part.filename = disposition_param(v, "filename");
            }
        }
        self.state = State::Data;
        Ok(part)
    }

    /// The next chunk of the current part's data; `None` at its end.
    pub async fn read_chunk(&mut self) -> Result<Option<Bytes>, MultipartError> {
        if self.state != State::Data {
            return Ok(None);
        }
        loop {
            if let Some(i) = self.find(&self.delimiter.clone()) {
                if i > 0 {
                    return Ok(Some(self.buf.split_to(i).freeze()));
                }
                self.buf.advance(self.delimiter.len());
                self.state = State::AfterDelimiter;
                return Ok(None);
            }
            // Everything but a possible delimiter prefix at the end is data.
            let safe = self.buf.len().saturating_sub(self.delimiter.len() - 1);
            if safe > 0 {
                return Ok(Some(self.buf.split_to(safe).freeze()));
            }
            if !self.fill().await? {
                return Err(malformed("the body ends inside a part"));
            }
        }
    }
}

/// A parameter of a `Content-Disposition` value (`name="file"`).
fn disposition_param(value: &str, key: &str) -> Option<String> {
    let mut rest = value;
    while let Some(i) = rest.find(';') {
        rest = &rest[i + 1..];
        let (k, v) = rest.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case(key) {
            continue;
        }
        let v = v.trim_start();
        if let Some(quoted) = v.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = quoted.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => out.extend(chars.next()),
                    '"' => return Some(out),
                    c => out.push(c),
                }
            }
            return None;
        }
        return Some(v.split(';').next().unwrap_or("").trim().to_string());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    type Chunks = futures_util::stream::Iter<std::vec::IntoIter<Result<Bytes, String>>>;

    fn body(raw: &[u8], chunk: usize) -> Chunks {
        let chunks: Vec<Result<Bytes, String>> =
            raw.chunks(chunk.max(1)).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        futures_util::stream::iter(chunks)
    }

    async fn read_all(mut m: Multipart<Chunks>) -> Result<Vec<(Part, Vec<u8>)>, MultipartError> {
        let mut out = Vec::new();
        while let Some(part) = m.next_part().await? {
            let mut data = Vec::new();
            while let Some(c) = m.read_chunk().await? {
                data.extend_from_slice(&c);
            }
            out.push((part, data));
        }
        Ok(out)
    }

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }

    const RAW: &[u8] = b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a/b.txt\"\r\n\
Content-Type: application/octet-stream\r\n\r\nhello\r\n--Xy not a boundary\r\n--XyZ\r\n\
Content-Disposition: form-data; name=\"file\"; filename=\"q\\\"uote\"\r\n\r\n\r\n--XyZ--\r\nepilogue";

    #[test]
    fn reads_parts_at_every_chunk_size() {
        for chunk in [1, 2, 3, 7, 16, 1000] {
            let parts = run(read_all(Multipart::new(body(RAW, chunk), "XyZ"))).unwrap();
            assert_eq!(parts.len(), 2, "chunk {chunk}");
            assert_eq!(parts[0].0.filename.as_deref(), Some("a/b.txt"));
            assert_eq!(parts[0].0.name.as_deref(), Some("file"));
            assert_eq!(parts[0].1, b"hello\r\n--Xy not a boundary");
            assert_eq!(parts[1].0.filename.as_deref(), Some("q\"uote"));
            assert_eq!(parts[1].1, b"");
        }
    }

    #[test]
    fn truncated_bodies_are_errors() {
        for cut in [5, 20, 60, 120, RAW.len() - 20] {
            let r = run(read_all(Multipart::new(body(&RAW[..cut], 4), "XyZ")));
            assert!(r.is_err(), "cut at {cut}");
        }
        let r = run(read_all(Multipart::new(body(b"no parts", 4), "XyZ")));
        assert!(matches!(r, Err(MultipartError::Malformed(_))));
    }

    #[test]
    fn boundary_comes_from_the_content_type() {
        assert_eq!(boundary("multipart/form-data; boundary=abc").as_deref(), Some("abc"));
        assert_eq!(boundary("Multipart/Form-Data; charset=x; boundary=\"a b\"").as_deref(), Some("a b"));
        assert_eq!(boundary("application/octet-stream"), None);
    }
}
