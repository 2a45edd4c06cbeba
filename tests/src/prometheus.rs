//! A strict reader of the Prometheus text format (0.0.4) for the suites
//! that scrape `GET /metrics` (a node's and an API server's).

use std::collections::BTreeMap;

/// One scrape: every sample by `name{labels}` exactly as written.
pub struct Scrape {
    pub samples: BTreeMap<String, f64>,
    pub text: String,
}

impl Scrape {
    /// The sample's value; 0 when the series does not exist yet (a counter
    /// with no event so far has no series).
    pub fn get(&self, series: &str) -> f64 {
        self.samples.get(series).copied().unwrap_or(0.0)
    }

    pub fn must(&self, series: &str) -> f64 {
        *self.samples.get(series).unwrap_or_else(|| panic!("no series `{series}` in:\n{}", self.text))
    }
}

/// Parses the Prometheus text format (0.0.4) strictly enough to catch a
/// broken encoder: every sample belongs to a family declared by `# TYPE`,
/// names and labels are well formed, values are numbers, counters end in
/// `_total`, histogram buckets grow and end with `+Inf` equal to `_count`.
pub fn parse(text: &str) -> Scrape {
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("bad TYPE line `{line}`"));
            assert!(name_ok(name), "bad family name in `{line}`");
            assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind), "bad type in `{line}`");
            assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "family `{name}` declared twice");
            continue;
        }
        if line.starts_with('#') {
            assert!(line.starts_with("# HELP ") || line == "# EOF", "unknown comment `{line}`");
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value in `{line}`"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("value of `{line}` is not a number")),
        };
        let name = series.split('{').next().unwrap_or_default();
        assert!(name_ok(name), "bad metric name in `{line}`");
        if let Some(labels) = series.strip_prefix(name).filter(|l| !l.is_empty()) {
            let inner = labels.strip_prefix('{').and_then(|l| l.strip_suffix('}'));
            let inner = inner.unwrap_or_else(|| panic!("bad label block in `{line}`"));
            for pair in inner.split("\",").filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once("=\"").unwrap_or_else(|| panic!("bad label `{pair}` in `{line}`"));
                assert!(name_ok(k) && !k.starts_with("__"), "bad label name `{k}` in `{line}`");
                assert!(!v.trim_end_matches('"').contains('"'), "unescaped quote in `{line}`");
            }
        }
        let family = types
            .iter()
            .filter(|(f, _)| name == f.as_str() || name.strip_prefix(f.as_str()).is_some_and(|s| s.starts_with('_')))
            .max_by_key(|(f, _)| f.len())
            .unwrap_or_else(|| panic!("sample `{line}` has no # TYPE before it"));
        match family.1.as_str() {
            "counter" => assert!(name.ends_with("_total") && value >= 0.0, "bad counter sample `{line}`"),
            "histogram" => assert!(
                ["_bucket", "_sum", "_count"].iter().any(|s| name.ends_with(s)),
                "bad histogram sample `{line}`"
            ),
            _ => {}
        }
        assert!(samples.insert(series.to_string(), value).is_none(), "series `{series}` twice");
    }
    check_histograms(&samples);
    Scrape { samples, text: text.to_string() }
}

/// Buckets of each histogram series never shrink, and `+Inf` is `_count`.
fn check_histograms(samples: &BTreeMap<String, f64>) {
    let mut buckets: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (series, value) in samples {
        let Some((name, labels)) = series.split_once("_bucket{") else { continue };
        let (rest, le) = labels.rsplit_once("le=\"").expect("a bucket has le");
        let le = le.trim_end_matches("\"}");
        let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().expect("le is a number") };
        let key = format!("{name}_count{{{}}}", rest.trim_end_matches(','));
        let key = key.replace("{}", "");
        buckets.entry(key).or_default().push((bound, *value));
    }
    for (count_series, mut b) in buckets {
        b.sort_by(|x, y| x.0.total_cmp(&y.0));
        assert!(b.windows(2).all(|w| w[0].1 <= w[1].1), "buckets of {count_series} shrink: {b:?}");
        let last = b.last().expect("a bucket");
        assert_eq!(last.0, f64::INFINITY, "{count_series} has no +Inf bucket");
        assert_eq!(Some(&last.1), samples.get(&count_series), "+Inf bucket of {count_series} is not its count");
    }
}

impl Scrape {
    /// The sum of every sample of `name` whose labels include all of
    /// `labels` (`("node", "n1")`), whatever its other labels.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|(series, _)| {
                let (n, rest) = series.split_once('{').unwrap_or((series.as_str(), ""));
                let has = |k: &str, v: &str| {
                    let pair = format!("{k}=\"{v}\"");
                    rest.starts_with(&pair) || rest.contains(&format!(",{pair}"))
                };
                n == name && labels.iter().all(|(k, v)| has(k, v))
            })
            .map(|(_, v)| v)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parser_rejects_broken_text() {
        let good = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 2\n";
        assert_eq!(parse(good).get("a_total{x=\"1\"}"), 2.0);
        for bad in [
            "a_total 1\n",
            "# TYPE a_total counter\na_total one\n",
            "# TYPE a counter\na 1\n",
            "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",
        ] {
            assert!(std::panic::catch_unwind(|| parse(bad)).is_err(), "accepted:\n{bad}");
        }
    }

    #[test]
    fn sum_adds_the_series_with_the_labels() {
        let text = concat!(
            "# TYPE a_total counter\n",
            "a_total{n=\"1\",r=\"x\"} 2\na_total{n=\"1\",r=\"y\"} 3\na_total{n=\"2\",r=\"x\"} 5\n",
            "a_total{xn=\"1\"} 7\n",
        );
        let scrape = parse(text);
        assert_eq!(scrape.sum("a_total", &[("n", "1")]), 5.0);
        assert_eq!(scrape.sum("a_total", &[("r", "x")]), 7.0);
        assert_eq!(scrape.sum("a_total", &[]), 17.0);
        assert_eq!(scrape.sum("b_total", &[]), 0.0);
    }
}
