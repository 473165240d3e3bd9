//! The `redis_ratelimit_metrics` page: every zone's figures in Prometheus's
//! text exposition format (0.0.4), or the same as JSON. Pure: the module
//! reads the figures from shared memory and hands them over.

use std::fmt::Write;

/// One zone's figures, all workers together.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Zone {
    pub name: String,
    /// Whether the zone has a Redis backend.
    pub redis: bool,
    pub passed: u64,
    pub rejected: u64,
    pub rejected_dry_run: u64,
    /// Keys (key and period pairs) in the table, and how many it holds.
    pub keys: u64,
    pub capacity: u64,
    pub evictions: u64,
}

/// A label value as the exposition format wants it: `\`, `"` and newlines
/// escaped.
fn label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// One metric family: its help, its type, one sample per zone.
fn family(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    zones: &[Zone],
    rows: &dyn Fn(&Zone) -> Vec<(String, u64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for z in zones {
        for (labels, v) in rows(z) {
            let _ = writeln!(out, "{name}{{zone=\"{}\"{labels}}} {v}", label(&z.name));
        }
    }
}

/// The Prometheus text exposition of `zones`.
pub fn prometheus(zones: &[Zone]) -> String {
    let mut out = String::new();
    family(
        &mut out,
        "nginx_redis_ratelimit_requests_total",
        "counter",
        "Requests a zone decided, by outcome (passed, rejected, rejected_dry_run), all workers.",
        zones,
        &|z| {
            vec![
                (",outcome=\"passed\"".into(), z.passed),
                (",outcome=\"rejected\"".into(), z.rejected),
                (",outcome=\"rejected_dry_run\"".into(), z.rejected_dry_run),
            ]
        },
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_keys",
        "gauge",
        "Keys (key and period pairs) in the zone's shared memory.",
        zones,
        &|z| vec![(String::new(), z.keys)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_keys_capacity",
        "gauge",
        "Keys the zone's shared memory holds.",
        zones,
        &|z| vec![(String::new(), z.capacity)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_evictions_total",
        "counter",
        "Least recently used keys evicted to make room.",
        zones,
        &|z| vec![(String::new(), z.evictions)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_redis_backend",
        "gauge",
        "1 when the zone counts through Redis, 0 when it counts in this node's memory only.",
        zones,
        &|z| vec![(String::new(), u64::from(z.redis))],
    );
    out
}

/// Whether a query string asks for JSON (`format=json` among its
/// arguments).
pub fn wants_json(args: &[u8]) -> bool {
    args.split(|&b| b == b'&').any(|a| a == b"format=json")
}

/// A JSON string.
fn json_str(v: &str) -> String {
    let mut out = String::with_capacity(v.len() + 2);
    out.push('"');
    for c in v.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The same figures as JSON: `{"zones": {"<name>": {...}}}`.
pub fn json(zones: &[Zone]) -> String {
    let mut out = String::from("{\"zones\":{");
    for (i, z) in zones.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            "{}:{{\"redis\":{},\"requests\":{{\"passed\":{},\"rejected\":{},\"rejected_dry_run\":{}}},\
             \"keys\":{},\"keys_capacity\":{},\"evictions\":{}}}",
            json_str(&z.name),
            z.redis,
            z.passed,
            z.rejected,
            z.rejected_dry_run,
            z.keys,
            z.capacity,
            z.evictions
        );
    }
    out.push_str("}}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zones() -> Vec<Zone> {
        vec![
            Zone {
                name: "login".into(),
                redis: true,
                passed: 10,
                rejected: 3,
                rejected_dry_run: 0,
                keys: 7,
                capacity: 15_742,
                evictions: 0,
            },
            Zone { name: "e\"dge\\".into(), passed: 1, ..Zone::default() },
        ]
    }

    #[test]
    fn prometheus_text_has_help_type_and_one_sample_per_zone() {
        let t = prometheus(&zones());
        assert!(t.contains("# HELP nginx_redis_ratelimit_requests_total "));
        assert!(t.contains("# TYPE nginx_redis_ratelimit_requests_total counter\n"));
        assert!(t.contains(
            "nginx_redis_ratelimit_requests_total{zone=\"login\",outcome=\"passed\"} 10\n"
        ));
        assert!(t.contains(
            "nginx_redis_ratelimit_requests_total{zone=\"login\",outcome=\"rejected\"} 3\n"
        ));
        assert!(t.contains("nginx_redis_ratelimit_keys{zone=\"login\"} 7\n"));
        assert!(t.contains("nginx_redis_ratelimit_keys_capacity{zone=\"login\"} 15742\n"));
        assert!(t.contains("nginx_redis_ratelimit_redis_backend{zone=\"login\"} 1\n"));
        // label values escaped
        assert!(t.contains("{zone=\"e\\\"dge\\\\\",outcome=\"passed\"} 1\n"));
        // every counter ends in _total; every family has HELP and TYPE
        for line in t.lines().filter(|l| l.starts_with("# TYPE")) {
            let parts: Vec<&str> = line.split(' ').collect();
            if parts[3] == "counter" {
                assert!(parts[2].ends_with("_total"), "{line}");
            }
            assert!(t.contains(&format!("# HELP {} ", parts[2])), "{line}");
        }
        assert!(t.ends_with('\n'));
    }

    #[test]
    fn format_argument() {
        assert!(wants_json(b"format=json"));
        assert!(wants_json(b"a=1&format=json"));
        assert!(!wants_json(b"format=jsonx"));
        assert!(!wants_json(b""));
    }

    #[test]
    fn json_has_the_same_figures() {
        let j = json(&zones());
        assert!(j.starts_with("{\"zones\":{\"login\":{\"redis\":true,"));
        assert!(j.contains("\"requests\":{\"passed\":10,\"rejected\":3,\"rejected_dry_run\":0}"));
        assert!(j.contains("\"keys\":7,\"keys_capacity\":15742,\"evictions\":0"));
        assert!(j.contains("\"e\\\"dge\\\\\":{\"redis\":false,"));
        assert_eq!(json(&[]), "{\"zones\":{}}\n");
    }
}
