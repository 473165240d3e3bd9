//! Text from outside (a client's value, a Redis server's error message)
//! made safe for one line of nginx's error log: bounded in length, with
//! control characters, quotes and bytes that are not UTF-8 escaped, so
//! that no value can break a log line in two or forge one.

use std::fmt::Write;

/// `v` as printable ASCII, at most `max` bytes of it (then `...`):
/// printable ASCII as is, `\n`, `\r`, `\t`, `\"`, `\\` and every other
/// byte as `\xNN`.
pub fn printable(v: &[u8], max: usize) -> String {
    let mut out = String::with_capacity(v.len().min(max) + 8);
    for &b in &v[..v.len().min(max)] {
        match b {
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(b as char),
            _ => {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    if v.len() > max {
        out.push_str("...");
    }
    out
}

/// A log message (ours, with a library's or a server's words in it) as
/// one line of at most `max` bytes: line breaks and other control
/// characters escaped (`\n`, `\r`, `\t`, `\xNN`), the rest kept, cut on a
/// character boundary (then `...`).
pub fn one_line(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max) + 8);
    for c in s.chars() {
        if out.len() >= max {
            out.push_str("...");
            break;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c) & 0xff);
            }
            c => out.push(c),
        }
    }
    out
}

/// A time in ms as nginx writes one: `15m`, `1h30m`, `2d`, `500ms`
/// (whole units, largest first; `0s` for none).
pub fn duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".into();
    }
    if !ms.is_multiple_of(1000) && ms < 60_000 {
        return if ms < 1000 { format!("{ms}ms") } else { format!("{}s", ms.div_ceil(1000)) };
    }
    let mut s = ms.div_ceil(1000);
    let mut out = String::new();
    for (unit, n) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if s >= n {
            let _ = write!(out, "{}{unit}", s / n);
            s %= n;
        }
    }
    out
}

/// A JSON string, quoted and escaped.
pub fn json_string(v: &str) -> String {
    let mut out = String::with_capacity(v.len() + 2);
    out.push('"');
    for c in v.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A structured-field string (RFC 9651), quoted and escaped: `"` and `\`
/// escaped, what is not printable ASCII written `?` (not allowed in one).
pub fn sf_string(v: &str) -> String {
    let mut out = String::with_capacity(v.len() + 2);
    out.push('"');
    for c in v.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_nginx_writes_them() {
        assert_eq!(duration(0), "0s");
        assert_eq!(duration(500), "500ms");
        assert_eq!(duration(1500), "2s");
        assert_eq!(duration(900_000), "15m");
        assert_eq!(duration(5_400_000), "1h30m");
        assert_eq!(duration(86_400_000 + 1000), "1d1s");
    }

    #[test]
    fn a_structured_field_string_is_quoted_and_escaped() {
        assert_eq!(sf_string("api"), "\"api\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(sf_string("é\t"), "\"??\"");
    }

    #[test]
    fn a_message_is_one_line() {
        let m = "zone \"a\": connecting to redis://h:1 failed: Parse error at 1\nUnexpected `84`\r\n\u{1b}[2J";
        assert_eq!(
            one_line(m, 1000),
            "zone \"a\": connecting to redis://h:1 failed: Parse error at 1\\nUnexpected `84`\\r\\n\\x1b[2J"
        );
        assert_eq!(one_line("dé\u{85}j", 100), "dé\\x85j");
    }

    #[test]
    fn a_long_message_is_cut_on_a_character() {
        let s = one_line(&"é".repeat(100), 11);
        assert_eq!(s, format!("{}...", "é".repeat(6)));
        assert_eq!(one_line("short", 5), "short");
    }

    #[test]
    fn printable_ascii_is_kept() {
        assert_eq!(
            printable(b"ERR wrong number of arguments", 100),
            "ERR wrong number of arguments"
        );
    }

    #[test]
    fn control_characters_quotes_and_other_bytes_are_escaped() {
        assert_eq!(printable(b"a\nb\r\tc", 100), "a\\nb\\r\\tc");
        assert_eq!(printable(b"say \"hi\" \\ ok", 100), "say \\\"hi\\\" \\\\ ok");
        assert_eq!(printable(b"\x00\x1b[31m\x7f\xff", 100), "\\x00\\x1b[31m\\x7f\\xff");
        assert_eq!(printable("é".as_bytes(), 100), "\\xc3\\xa9");
    }

    #[test]
    fn long_text_is_cut() {
        let s = printable(&[b'a'; 1000], 64);
        assert_eq!(s.len(), 67);
        assert!(s.ends_with("..."));
        assert_eq!(printable(b"", 10), "");
    }

    #[test]
    fn no_output_ever_holds_a_line_break() {
        let all: Vec<u8> = (0..=255).collect();
        let s = printable(&all, 1000);
        assert!(!s.contains('\n') && !s.contains('\r'));
        assert!(s.bytes().all(|b| (0x20..=0x7e).contains(&b)));
    }
}
