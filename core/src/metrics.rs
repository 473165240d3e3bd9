//! The `redis_ratelimit_metrics` page: every zone's figures in Prometheus's
//! text exposition format (0.0.4), or the same as JSON. Pure: the module
//! reads the figures from shared memory (`stats`) and hands them over.

use std::fmt::Write;

use crate::stats::RTT_BUCKETS_US;

/// One zone's figures, all workers together.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Zone {
    pub name: String,
    pub passed: u64,
    pub rejected: u64,
    pub rejected_dry_run: u64,
    /// Requests whose key was empty (not limited).
    pub not_limited: u64,
    /// Keys (key and period pairs) in the table, and how many it holds.
    pub keys: u64,
    pub capacity: u64,
    pub evictions: u64,
    pub breaker_trips: u64,
    pub dropped: u64,
    /// The Redis backend's figures; `None` for a zone without `redis=`.
    pub redis: Option<Redis>,
}

/// What a zone's Redis threads did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Redis {
    pub up: bool,
    /// `on_error=`: `local`, `allow`, `deny` or `share`.
    pub on_error: &'static str,
    pub commands: u64,
    pub pipelines: u64,
    pub errors_transport: u64,
    pub errors_reply: u64,
    pub connects: u64,
    /// Increments waiting to be sent (all workers).
    pub waiting: u64,
    /// Seconds since a flush last went through (`None`: never).
    pub sync_age_s: Option<f64>,
    /// Round trips per bucket of `RTT_BUCKETS_US`, then above them all (not
    /// cumulative).
    pub rtt_buckets: Vec<u64>,
    pub rtt_sum_us: u64,
    /// Requests that waited for Redis's decision (`strict`), and those that
    /// got none (`timeout=`, a failed exchange, an error reply).
    pub strict_waits: u64,
    pub strict_timeouts: u64,
    /// The nodes counting the zone through its Redis lately, as this
    /// worker's thread last read them (`on_error=share`; 0: not known).
    pub nodes: u64,
    /// The process id of the worker that sends the node's counts of the
    /// zone (0: none now). JSON only: a process id is no metric.
    pub sender: u64,
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

fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// One metric family with one sample per zone (and per extra label set
/// `rows` gives).
fn family<T: std::fmt::Display>(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    zones: &[Zone],
    rows: &dyn Fn(&Zone) -> Vec<(String, T)>,
) {
    head(out, name, kind, help);
    for z in zones {
        for (labels, v) in rows(z) {
            let _ = writeln!(out, "{name}{{zone=\"{}\"{labels}}} {v}", label(&z.name));
        }
    }
}

/// Seconds, as Prometheus prints them.
fn secs(us: u64) -> String {
    format!("{}", us as f64 / 1e6)
}

/// The Prometheus text exposition of `zones`.
pub fn prometheus(zones: &[Zone]) -> String {
    let mut out = String::new();
    family(
        &mut out,
        "nginx_redis_ratelimit_requests_total",
        "counter",
        "Requests a zone decided, by outcome (passed, rejected, rejected_dry_run; not_limited: the key was empty), all workers.",
        zones,
        &|z| {
            vec![
                (",outcome=\"passed\"".into(), z.passed),
                (",outcome=\"rejected\"".into(), z.rejected),
                (",outcome=\"rejected_dry_run\"".into(), z.rejected_dry_run),
                (",outcome=\"not_limited\"".into(), z.not_limited),
            ]
        },
    );
    let one = |f: fn(&Zone) -> u64| move |z: &Zone| vec![(String::new(), f(z))];
    family(
        &mut out,
        "nginx_redis_ratelimit_keys",
        "gauge",
        "Keys (key and period pairs) in the zone's shared memory.",
        zones,
        &one(|z| z.keys),
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_keys_capacity",
        "gauge",
        "Keys the zone's shared memory holds.",
        zones,
        &one(|z| z.capacity),
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_evictions_total",
        "counter",
        "Least recently used keys evicted to make room.",
        zones,
        &one(|z| z.evictions),
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_breaker_trips_total",
        "counter",
        "Keys whose breaker opened (Redis's counts put the key over its limit: its requests are refused without a look at the counts), once per key and window.",
        zones,
        &one(|z| z.breaker_trips),
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_dropped_increments_total",
        "counter",
        "Counted requests the queue to the Redis thread had no room for (counted on this node only).",
        zones,
        &one(|z| z.dropped),
    );

    let redis: Vec<Zone> = zones.iter().filter(|z| z.redis.is_some()).cloned().collect();
    let r = |z: &Zone| z.redis.clone().unwrap_or_default();
    family(
        &mut out,
        "nginx_redis_ratelimit_backend_up",
        "gauge",
        "1 while the zone's Redis backend works, 0 while it is down (as its threads last saw it).",
        &redis,
        &|z| vec![(String::new(), u64::from(r(z).up))],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_on_error",
        "gauge",
        "The zone's on_error policy (1 for the one in force while Redis is down).",
        &redis,
        &|z| vec![(format!(",policy=\"{}\"", r(z).on_error), 1u64)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_redis_nodes",
        "gauge",
        "Nodes counting the zone through its Redis lately (on_error=share; 0: not known).",
        &redis,
        &|z| vec![(String::new(), r(z).nodes)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_redis_commands_total",
        "counter",
        "Redis commands sent.",
        &redis,
        &|z| vec![(String::new(), r(z).commands)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_redis_pipelines_total",
        "counter",
        "Pipelines (flushes, checks, TTL fixes) sent to Redis.",
        &redis,
        &|z| vec![(String::new(), r(z).pipelines)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_redis_errors_total",
        "counter",
        "Redis errors: transport (refused, reset, timeout, TLS, cluster down) or reply (an error reply to one command).",
        &redis,
        &|z| {
            vec![
                (",kind=\"transport\"".into(), r(z).errors_transport),
                (",kind=\"reply\"".into(), r(z).errors_reply),
            ]
        },
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_redis_connects_total",
        "counter",
        "Connections made to Redis.",
        &redis,
        &|z| vec![(String::new(), r(z).connects)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_increments_waiting",
        "gauge",
        "Counted requests waiting on this node to be sent to Redis (held far from the limit, or kept through an outage).",
        &redis,
        &|z| vec![(String::new(), r(z).waiting)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_last_sync_age_seconds",
        "gauge",
        "Seconds that counts have waited on this node without a flush to Redis going through (since the later of the last flush and the oldest count waiting); 0 while none waits.",
        &redis,
        &|z| r(z).sync_age_s.map(|a| (String::new(), a)).into_iter().collect(),
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_strict_waits_total",
        "counter",
        "Requests that waited for Redis's decision (strict limits).",
        &redis,
        &|z| vec![(String::new(), r(z).strict_waits)],
    );
    family(
        &mut out,
        "nginx_redis_ratelimit_strict_timeouts_total",
        "counter",
        "Strict requests whose wait ended without Redis's decision (timeout=, a failed exchange, an error reply): decided by on_error.",
        &redis,
        &|z| vec![(String::new(), r(z).strict_timeouts)],
    );
    let name = "nginx_redis_ratelimit_redis_roundtrip_seconds";
    head(&mut out, name, "histogram", "Round trips of the pipelines sent to Redis.");
    for z in &redis {
        let rz = r(z);
        let zl = label(&z.name);
        let mut cumulative = 0;
        for (i, n) in rz.rtt_buckets.iter().enumerate() {
            cumulative += n;
            let le = RTT_BUCKETS_US.get(i).map_or("+Inf".to_string(), |&b| secs(b));
            let _ = writeln!(out, "{name}_bucket{{zone=\"{zl}\",le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum{{zone=\"{zl}\"}} {}", secs(rz.rtt_sum_us));
        let _ = writeln!(out, "{name}_count{{zone=\"{zl}\"}} {cumulative}");
    }
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
            "{}:{{\"requests\":{{\"passed\":{},\"rejected\":{},\"rejected_dry_run\":{},\"not_limited\":{}}},\
             \"keys\":{},\"keys_capacity\":{},\"evictions\":{},\"breaker_trips\":{},\
             \"dropped_increments\":{},\"redis\":",
            json_str(&z.name),
            z.passed,
            z.rejected,
            z.rejected_dry_run,
            z.not_limited,
            z.keys,
            z.capacity,
            z.evictions,
            z.breaker_trips,
            z.dropped,
        );
        match &z.redis {
            None => out.push_str("null}"),
            Some(r) => {
                let age = r.sync_age_s.map_or("null".to_string(), |a| a.to_string());
                let buckets: Vec<String> = r.rtt_buckets.iter().map(u64::to_string).collect();
                let _ = write!(
                    out,
                    "{{\"up\":{},\"on_error\":\"{}\",\"commands\":{},\"pipelines\":{},\
                     \"errors\":{{\"transport\":{},\"reply\":{}}},\"connects\":{},\"waiting\":{},\
                     \"last_sync_age_seconds\":{age},\"roundtrip_buckets_us\":{:?},\
                     \"roundtrip_counts\":[{}],\"roundtrip_sum_seconds\":{},\
                     \"strict\":{{\"waits\":{},\"timeouts\":{}}},\"nodes\":{},\"sender\":{}}}}}",
                    r.up,
                    r.on_error,
                    r.commands,
                    r.pipelines,
                    r.errors_transport,
                    r.errors_reply,
                    r.connects,
                    r.waiting,
                    RTT_BUCKETS_US,
                    buckets.join(","),
                    secs(r.rtt_sum_us),
                    r.strict_waits,
                    r.strict_timeouts,
                    r.nodes,
                    r.sender,
                );
            }
        }
    }
    out.push_str("}}\n");
    out
}

#[cfg(test)]
#[path = "metrics_tests.rs"]
mod tests;
