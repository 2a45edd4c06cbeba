//! Bounded capture of one output stream: the first half of the cap is kept as
//! the head, the last half as a rolling tail, and the bytes in between are
//! only counted. `yes` for an hour costs at most `cap` bytes of memory.

use std::collections::VecDeque;

/// A piece of a stream as a reader at some offset sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Data {
        offset: u64,
        bytes: Vec<u8>,
    },
    /// `len` bytes from `offset` on were dropped.
    Gap {
        offset: u64,
        len: u64,
    },
}

#[derive(Debug, Clone)]
pub struct Capture {
    head: Vec<u8>,
    head_cap: usize,
    tail: VecDeque<u8>,
    tail_cap: usize,
    total: u64,
}

impl Capture {
    /// `cap` is the total number of bytes kept (head + tail), at least 2.
    pub fn new(cap: u64) -> Self {
        let cap = usize::try_from(cap.max(2)).unwrap_or(usize::MAX);
        let head_cap = cap / 2;
        Capture { head: Vec::new(), head_cap, tail: VecDeque::new(), tail_cap: cap - head_cap, total: 0 }
    }

    /// Rebuilds a finished capture from its client-facing record, so a
    /// stored exec is read back exactly as a live one is.
    pub fn restore(output: &warren_api::CapturedOutput) -> Self {
        use base64::Engine as _;
        let kept = base64::engine::general_purpose::STANDARD.decode(&output.data_b64).unwrap_or_default();
        let head_len = output.dropped_at.map_or(kept.len(), |h| (h as usize).min(kept.len()));
        let (head, tail) = kept.split_at(head_len);
        Capture {
            head: head.to_vec(),
            head_cap: head.len(),
            tail: tail.iter().copied().collect(),
            tail_cap: tail.len(),
            total: output.total_bytes.max(kept.len() as u64),
        }
    }

    pub fn append(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.head_cap {
            let take = data.len().min(self.head_cap - self.head.len());
            self.head.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
            return;
        }
        let overflow = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
        self.tail.drain(..overflow);
        self.tail.extend(data);
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    fn tail_start(&self) -> u64 {
        self.total - self.tail.len() as u64
    }

    pub fn dropped(&self) -> u64 {
        self.tail_start() - self.head.len() as u64
    }

    /// Everything kept from `offset` on, with a `Gap` for what was dropped.
    pub fn read_from(&self, mut offset: u64) -> Vec<Chunk> {
        let mut out = Vec::new();
        let head_len = self.head.len() as u64;
        if offset < head_len {
            out.push(Chunk::Data { offset, bytes: self.head[offset as usize..].to_vec() });
            offset = head_len;
        }
        let tail_start = self.tail_start();
        if offset < tail_start {
            out.push(Chunk::Gap { offset, len: tail_start - offset });
            offset = tail_start;
        }
        if offset < self.total {
            let skip = (offset - tail_start) as usize;
            out.push(Chunk::Data { offset, bytes: self.tail.iter().skip(skip).copied().collect() });
        }
        out
    }

    /// The kept bytes, head then tail, as a client-facing record.
    pub fn to_output(&self) -> warren_api::CapturedOutput {
        use base64::Engine as _;
        let mut kept = self.head.clone();
        kept.extend(self.tail.iter());
        let dropped = self.dropped();
        warren_api::CapturedOutput {
            text: String::from_utf8_lossy(&kept).into_owned(),
            data_b64: base64::engine::general_purpose::STANDARD.encode(&kept),
            total_bytes: self.total,
            dropped_bytes: dropped,
            dropped_at: (dropped > 0).then_some(self.head.len() as u64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(chunks: &[Chunk]) -> Vec<u8> {
        chunks
            .iter()
            .flat_map(|c| match c {
                Chunk::Data { bytes, .. } => bytes.clone(),
                Chunk::Gap { .. } => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn small_output_is_kept_whole() {
        let mut c = Capture::new(16);
        c.append(b"hello ");
        c.append(b"world");
        assert_eq!(c.total(), 11);
        assert_eq!(c.dropped(), 0);
        assert_eq!(data(&c.read_from(0)), b"hello world");
        assert_eq!(data(&c.read_from(6)), b"world");
        assert!(c.read_from(11).is_empty());
        assert_eq!(c.to_output().text, "hello world");
    }

    #[test]
    fn overflow_keeps_head_and_tail_and_counts_the_middle() {
        let mut c = Capture::new(8);
        for b in b"abcdefghijklmnopqrstuvwxyz".chunks(3) {
            c.append(b);
        }
        assert_eq!(c.total(), 26);
        assert_eq!(c.dropped(), 18);
        let chunks = c.read_from(0);
        assert_eq!(
            chunks,
            vec![
                Chunk::Data { offset: 0, bytes: b"abcd".to_vec() },
                Chunk::Gap { offset: 4, len: 18 },
                Chunk::Data { offset: 22, bytes: b"wxyz".to_vec() },
            ]
        );
        // A reader resuming inside the dropped range is told about the rest of the gap.
        assert_eq!(c.read_from(10)[0], Chunk::Gap { offset: 10, len: 12 });
        assert_eq!(data(&c.read_from(24)), b"yz");
        let out = c.to_output();
        assert_eq!((out.text.as_str(), out.dropped_bytes, out.dropped_at), ("abcdwxyz", 18, Some(4)));
    }

    #[test]
    fn a_restored_capture_reads_back_like_the_original() {
        let mut c = Capture::new(8);
        c.append(b"abcdefghijklmnopqrstuvwxyz");
        let restored = Capture::restore(&c.to_output());
        for offset in [0, 3, 4, 10, 22, 25, 26] {
            assert_eq!(restored.read_from(offset), c.read_from(offset), "offset {offset}");
        }
        let mut small = Capture::new(64);
        small.append(b"whole");
        assert_eq!(Capture::restore(&small.to_output()).read_from(1), small.read_from(1));
    }

    #[test]
    fn one_huge_append_is_bounded() {
        let mut c = Capture::new(10);
        c.append(&vec![b'y'; 1 << 20]);
        c.append(b"END");
        assert_eq!(c.total(), (1 << 20) + 3);
        assert_eq!(data(&c.read_from(0)), b"yyyyyyyEND");
        assert_eq!(c.dropped(), (1 << 20) + 3 - 10);
    }
}
