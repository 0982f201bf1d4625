//! Samples of the Prometheus text exposition format (and OpenMetrics text), with their labels.
//!
//! Engines' `/metrics` carry label values with every character the format allows: vLLM's
//! `vllm:cache_config_info` has values such as `"[]"` and `"None"`, and a value may hold `}`, `,`, a
//! quote or a newline, escaped. Each line is read by the format's grammar (name, optional
//! `{label="value",...}` with `\\`, `\"` and `\n` escapes, value, optional timestamp), not by
//! splitting on punctuation. The crates on crates.io were tried first and fall short on real engine
//! scrapes: `prometheus-parse` 0.2.5 matches a label set with `[^}]+`, so a `}` in a value breaks
//! the line; `nom-openmetrics` 0.3 takes no sample timestamps, refuses the whole exposition for one
//! line it does not know, and writes to stderr whenever it reads an infinity. Hence this grammar,
//! property-tested against its own renderer.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, e.g. `vllm:num_requests_running`.
    pub name: String,
    /// Labels in the order written.
    pub labels: Vec<(String, String)>,
    /// The value (`NaN` and `±Inf` included).
    pub value: f64,
}

impl Sample {
    /// A label's value.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Every well-formed sample in `text`, in order; comments, blank lines and malformed lines are skipped
/// (a scrape is read for what it has, not refused for one bad line).
pub fn samples(text: &str) -> impl Iterator<Item = Sample> + '_ {
    text.lines().filter_map(|line| parse_line(line.trim()))
}

fn is_name_char(c: char, first: bool) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':' || (!first && c.is_ascii_digit())
}

/// Parses one sample line; `None` for comments, blanks and anything malformed.
pub fn parse_line(line: &str) -> Option<Sample> {
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let mut chars = line.char_indices().peekable();
    let mut end = 0;
    while let Some(&(i, c)) = chars.peek() {
        if !is_name_char(c, i == 0) {
            break;
        }
        end = i + c.len_utf8();
        chars.next();
    }
    if end == 0 {
        return None;
    }
    let name = line[..end].to_owned();
    let mut labels = Vec::new();
    let mut rest = &line[end..];
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, remaining) = parse_labels(after)?;
        labels = parsed;
        rest = remaining;
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample { name, labels, value })
}

/// Reads `name="value",...}`, returning the labels and what follows the closing brace.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        if key.is_empty() || !key.chars().enumerate().all(|(i, c)| is_name_char(c, i == 0) && c != ':') {
            return None;
        }
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let close = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((key.to_owned(), value));
        s = s[close + 1..].trim_start();
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_with_colons_and_labels_with_any_character_parse() {
        let s = parse_line(r#"vllm:cache_config_info{block_size="32",weird="a}b,\"c\"\nd",empty=""} 1.0 1700000000"#)
            .unwrap();
        assert_eq!(s.name, "vllm:cache_config_info");
        assert_eq!(s.label("block_size"), Some("32"));
        assert_eq!(s.label("weird"), Some("a}b,\"c\"\nd"));
        assert_eq!(s.label("empty"), Some(""));
        assert_eq!(s.value, 1.0);
        let bare = parse_line("process_start_time_seconds 1.796114799e+09").unwrap();
        assert_eq!(
            (bare.name.as_str(), bare.value, bare.labels.len()),
            ("process_start_time_seconds", 1_796_114_799.0, 0)
        );
        assert!(parse_line("x{a=\"1\"} +Inf").unwrap().value.is_infinite());
        assert!(parse_line("x NaN").unwrap().value.is_nan());
    }

    #[test]
    fn malformed_lines_are_skipped() {
        for bad in ["# HELP x y", "", "{a=\"1\"} 1", "x{a=1} 1", "x{a=\"1\" 1", "x", "x one", "9x 1"] {
            assert_eq!(parse_line(bad), None, "{bad}");
        }
        let text = "# TYPE a gauge\na 1\nbroken{\nb{x=\"y\"} 2\n";
        assert_eq!(samples(text).map(|s| s.name).collect::<Vec<_>>(), vec!["a", "b"]);
    }

    /// A sample line as a Prometheus client library writes it: label values escaped.
    fn render(name: &str, labels: &[(String, String)], value: f64) -> String {
        let escape = |v: &str| v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        let set: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        if set.is_empty() {
            format!("{name} {value:?}")
        } else {
            format!("{name}{{{}}} {value:?}", set.join(","))
        }
    }

    proptest::proptest! {
        #[test]
        fn any_rendered_sample_parses_back_to_itself(
            name in "[a-zA-Z_:][a-zA-Z0-9_:]{0,20}",
            labels in proptest::collection::vec(("[a-zA-Z_][a-zA-Z0-9_]{0,10}", "[ -~\n{}\",=\\\\]{0,16}"), 0..4),
            value in -1e12f64..1e12,
        ) {
            let parsed = parse_line(&render(&name, &labels, value));
            proptest::prop_assert_eq!(parsed, Some(Sample { name, labels, value }));
        }
    }
}
