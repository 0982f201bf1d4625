//! `json.dumps` as Python writes it, for the `tojson` filter of chat templates.
//!
//! HuggingFace's chat-template environment replaces Jinja's `tojson` with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`
//! (`transformers/utils/chat_template_utils.py`). Templates that render tools or tool calls
//! with it put that exact text into the prompt, so every byte matters for prefix caching: item
//! separators `", "` and `": "` (`","` when indenting), insertion-ordered keys, Python's float
//! `repr`, and non-ASCII characters written as they are unless `ensure_ascii` is set.

use minijinja::value::{Value, ValueKind};

/// How to write the JSON: `json.dumps`'s keyword arguments.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// Indent nested containers by this many spaces, one item per line.
    pub indent: Option<String>,
    /// Item and key separators; Python's defaults depend on `indent`.
    pub separators: Option<(String, String)>,
    /// Write object keys in sorted order.
    pub sort_keys: bool,
}

/// Writes `value` as Python's `json.dumps` would with `opts`.
pub fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, String> {
    let (item, key) = match &opts.separators {
        Some((i, k)) => (i.clone(), k.clone()),
        None if opts.indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut out = String::new();
    Writer { opts, item, key }.write(value, 0, &mut out)?;
    Ok(out)
}

struct Writer<'a> {
    opts: &'a DumpOptions,
    item: String,
    key: String,
}

impl Writer<'_> {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.opts.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), String> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if let Some(i) = v.as_i64() {
                    if v.is_integer() {
                        out.push_str(&i.to_string());
                        return Ok(());
                    }
                }
                match f64::try_from(v.clone()) {
                    Ok(f) if v.is_integer() => out.push_str(&format!("{f:.0}")),
                    Ok(f) => out.push_str(&float_repr(f)),
                    Err(_) => out.push_str(&v.to_string()),
                }
            }
            ValueKind::String | ValueKind::Bytes => {
                write_string(v.as_str().unwrap_or_default(), self.opts.ensure_ascii, out);
            }
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Plain => {
                let items: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
                if self.opts.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    let name = match k.as_str() {
                        Some(s) => s.to_owned(),
                        None if k.is_none() => "null".to_owned(),
                        None => k.to_string(),
                    };
                    write_string(&name, self.opts.ensure_ascii, out);
                    out.push_str(&self.key);
                    let item = v.get_item(k).map_err(|e| e.to_string())?;
                    self.write(&item, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push('}');
            }
            // Anything else (functions, invalid values) has no JSON form in Python either.
            _ => return Err(format!("cannot serialise a {} to JSON", v.kind())),
        }
        Ok(())
    }
}

fn write_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed notation when the decimal
/// exponent is from -4 to 15 and in scientific notation (`1e+16`, `1e-05`) otherwise.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "d.ddde±x".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} writes an integer exponent");
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{s}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(json: &str) -> Value {
        Value::from_serialize(serde_json::from_str::<serde_json::Value>(json).unwrap())
    }

    #[test]
    fn floats_print_as_python_repr_does() {
        for (f, py) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5, "-2.5"),
            (123456.789, "123456.789"),
            (1.5e300, "1.5e+300"),
        ] {
            assert_eq!(float_repr(f), py, "{f}");
        }
    }

    #[test]
    fn objects_keep_their_key_order_and_pythons_separators() {
        let x =
            v(r#"{"name": "get_weather", "parameters": {"type": "object", "b": [1, 2.5, null, true]}, "a": "é\n\""}"#);
        assert_eq!(
            dumps(&x, &DumpOptions::default()).unwrap(),
            r#"{"name": "get_weather", "parameters": {"type": "object", "b": [1, 2.5, null, true]}, "a": "é\n\""}"#
        );
        let ascii = DumpOptions { ensure_ascii: true, ..DumpOptions::default() };
        assert_eq!(dumps(&v(r#""é🙂""#), &ascii).unwrap(), r#""\u00e9\ud83d\ude42""#);
        let sorted = DumpOptions { sort_keys: true, ..DumpOptions::default() };
        assert_eq!(dumps(&v(r#"{"b": 1, "a": {}}"#), &sorted).unwrap(), r#"{"a": {}, "b": 1}"#);
    }

    #[test]
    fn indentation_puts_one_item_per_line() {
        let opts = DumpOptions { indent: Some("  ".into()), ..DumpOptions::default() };
        assert_eq!(
            dumps(&v(r#"{"a": [1, 2], "b": {}}"#), &opts).unwrap(),
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {}\n}"
        );
    }
}
