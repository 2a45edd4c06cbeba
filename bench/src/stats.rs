//! Latency samples, failure tallies and the figures derived from them.

use std::collections::BTreeMap;
use std::time::Duration;

/// At most this many distinct failure messages are kept as examples.
const MAX_FAILURE_EXAMPLES: usize = 4;

/// Failed attempts: how many, and a few distinct messages with their counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Failures {
    pub count: u64,
    pub examples: BTreeMap<String, u64>,
}

impl Failures {
    pub fn record(&mut self, message: impl Into<String>) {
        self.count += 1;
        let message = message.into();
        if let Some(n) = self.examples.get_mut(&message) {
            *n += 1;
        } else if self.examples.len() < MAX_FAILURE_EXAMPLES {
            self.examples.insert(message, 1);
        }
    }

    pub fn merge(&mut self, other: Failures) {
        self.count += other.count;
        for (message, n) in other.examples {
            if let Some(mine) = self.examples.get_mut(&message) {
                *mine += n;
            } else if self.examples.len() < MAX_FAILURE_EXAMPLES {
                self.examples.insert(message, n);
            }
        }
    }

    /// `none`, or the count and the examples on one line.
    pub fn summary(&self) -> String {
        if self.count == 0 {
            return "none".into();
        }
        let examples: Vec<String> = self.examples.iter().map(|(m, n)| format!("{n}x `{}`", one_line(m))).collect();
        format!("{} ({})", self.count, examples.join("; "))
    }
}

fn one_line(s: &str) -> String {
    let flat: String = s.chars().map(|c| if c == '\n' || c == '|' { ' ' } else { c }).collect();
    if flat.chars().count() > 160 {
        format!("{}...", flat.chars().take(160).collect::<String>())
    } else {
        flat
    }
}

/// Successful samples of one operation plus the failed attempts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Latencies {
    sorted: Vec<Duration>,
    pub failures: Failures,
}

impl Latencies {
    pub fn push(&mut self, d: Duration) {
        let at = self.sorted.partition_point(|x| *x <= d);
        self.sorted.insert(at, d);
    }

    pub fn fail(&mut self, message: impl Into<String>) {
        self.failures.record(message);
    }

    pub fn merge(&mut self, other: Latencies) {
        for d in other.sorted {
            self.push(d);
        }
        self.failures.merge(other.failures);
    }

    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// Nearest-rank percentile: the smallest sample at or above `p` percent
    /// of all samples. No interpolation, so every figure is a measured value.
    pub fn percentile(&self, p: f64) -> Option<Duration> {
        if self.sorted.is_empty() || !(0.0..=100.0).contains(&p) {
            return None;
        }
        let rank = ((p / 100.0) * self.sorted.len() as f64).ceil() as usize;
        Some(self.sorted[rank.clamp(1, self.sorted.len()) - 1])
    }

    pub fn p50(&self) -> Option<Duration> {
        self.percentile(50.0)
    }

    pub fn p99(&self) -> Option<Duration> {
        self.percentile(99.0)
    }

    pub fn max(&self) -> Option<Duration> {
        self.sorted.last().copied()
    }

    pub fn mean(&self) -> Option<Duration> {
        let n = u32::try_from(self.sorted.len()).ok().filter(|n| *n > 0)?;
        Some(self.sorted.iter().sum::<Duration>() / n)
    }
}

/// Milliseconds with a precision that suits the magnitude.
pub fn ms(d: Duration) -> String {
    let v = d.as_secs_f64() * 1000.0;
    if v >= 100.0 {
        format!("{v:.0} ms")
    } else if v >= 10.0 {
        format!("{v:.1} ms")
    } else {
        format!("{v:.2} ms")
    }
}

pub fn opt_ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), ms)
}

/// Bytes as KiB or MiB, whichever reads better.
pub fn bytes(b: f64) -> String {
    if b.abs() >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else {
        format!("{:.0} KiB", b / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lat(ms: &[u64]) -> Latencies {
        let mut l = Latencies::default();
        for m in ms {
            l.push(Duration::from_millis(*m));
        }
        l
    }

    #[test]
    fn nearest_rank_percentiles_pick_measured_values() {
        let l = lat(&(1..=200).rev().collect::<Vec<_>>());
        assert_eq!(l.p50(), Some(Duration::from_millis(100)));
        assert_eq!(l.p99(), Some(Duration::from_millis(198)));
        assert_eq!(l.max(), Some(Duration::from_millis(200)));
        assert_eq!(l.percentile(0.0), Some(Duration::from_millis(1)));
        let odd = lat(&[5, 1, 3]);
        assert_eq!(odd.p50(), Some(Duration::from_millis(3)));
        assert_eq!(odd.p99(), Some(Duration::from_millis(5)));
    }

    #[test]
    fn empty_samples_have_no_figures() {
        let l = Latencies::default();
        assert_eq!((l.p50(), l.mean(), l.max()), (None, None, None));
        assert_eq!(lat(&[1]).percentile(101.0), None);
    }

    #[test]
    fn mean_and_merge_cover_all_samples() {
        let mut a = lat(&[1, 3]);
        a.fail("boom");
        let mut b = lat(&[2]);
        b.fail("boom");
        b.fail("bang");
        a.merge(b);
        assert_eq!(a.len(), 3);
        assert_eq!(a.mean(), Some(Duration::from_millis(2)));
        assert_eq!(a.failures.count, 3);
        assert_eq!(a.failures.examples.get("boom"), Some(&2));
    }

    #[test]
    fn failure_examples_are_bounded_but_counted() {
        let mut f = Failures::default();
        for i in 0..10 {
            f.record(format!("error {i}"));
        }
        assert_eq!(f.count, 10);
        assert_eq!(f.examples.len(), MAX_FAILURE_EXAMPLES);
        assert!(f.summary().starts_with("10 ("));
        assert_eq!(Failures::default().summary(), "none");
    }

    #[test]
    fn units_read_naturally() {
        assert_eq!(ms(Duration::from_micros(4_900)), "4.90 ms");
        assert_eq!(ms(Duration::from_micros(25_400)), "25.4 ms");
        assert_eq!(ms(Duration::from_millis(1234)), "1234 ms");
        assert_eq!(bytes(653_312.0), "638 KiB");
        assert_eq!(bytes(3.0 * 1024.0 * 1024.0), "3.00 MiB");
    }
}
