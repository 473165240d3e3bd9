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
    /// Passed requests a bucket delayed.
    pub delayed: u64,
    /// Requests in flight holding a concurrency limit's slot, and those a
    /// full one refused (or let through in dry run).
    pub conn_in_flight: u64,
    pub conn_rejected: u64,
    pub conn_rejected_dry_run: u64,
    pub conn_leased: u64,
    pub conn_expired: u64,
    /// Keys a `block=` line blocked on this node; keys blocked now, and
    /// keys with an override now (operators' and penalties').
    pub blocks: u64,
    pub blocked_keys: u64,
    pub overridden_keys: u64,
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

fn secs(us: u64) -> String {
    format!("{}", us as f64 / 1e6)
}

/// A family's samples of one zone: extra labels (`,name="value"`), value
/// as written.
type Samples = Vec<(String, String)>;

/// Where a family's samples come from: every zone's figures, or a Redis
/// zone's backend (zones without `redis=` have none).
enum Of {
    Zone(fn(&Zone) -> Samples),
    Redis(fn(&Redis) -> Samples),
}

/// One metric family of the page.
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    of: Of,
}

fn one(v: u64) -> Samples {
    vec![(String::new(), v.to_string())]
}

/// The page's families, in order (the round-trip histogram follows them).
const FAMILIES: &[Family] = &[
    Family {
        name: "nginx_redis_ratelimit_requests_total",
        kind: "counter",
        help: "Requests a zone decided, by outcome (passed, rejected, rejected_dry_run; not_limited: the key was empty), all workers.",
        of: Of::Zone(|z| {
            vec![
                (",outcome=\"passed\"".into(), z.passed.to_string()),
                (",outcome=\"rejected\"".into(), z.rejected.to_string()),
                (",outcome=\"rejected_dry_run\"".into(), z.rejected_dry_run.to_string()),
                (",outcome=\"not_limited\"".into(), z.not_limited.to_string()),
            ]
        }),
    },
    Family {
        name: "nginx_redis_ratelimit_delayed_total",
        kind: "counter",
        help: "Passed requests a bucket (burst= without nodelay, delay=) delayed first, also counted as passed.",
        of: Of::Zone(|z| one(z.delayed)),
    },
    Family {
        name: "nginx_redis_ratelimit_conn_in_flight",
        kind: "gauge",
        help: "Requests in flight holding a slot of the zone's concurrency limits (redis_ratelimit_conn) on this node.",
        of: Of::Zone(|z| one(z.conn_in_flight)),
    },
    Family {
        name: "nginx_redis_ratelimit_conn_rejected_total",
        kind: "counter",
        help: "Requests the zone's concurrency limits refused (rejected), or let through in dry run (rejected_dry_run).",
        of: Of::Zone(|z| {
            vec![
                (",outcome=\"rejected\"".into(), z.conn_rejected.to_string()),
                (",outcome=\"rejected_dry_run\"".into(), z.conn_rejected_dry_run.to_string()),
            ]
        }),
    },
    Family {
        name: "nginx_redis_ratelimit_conn_leased",
        kind: "gauge",
        help: "Slots of the zone's concurrency limits this node holds leases of in Redis (in flight and spare).",
        of: Of::Zone(|z| one(z.conn_leased)),
    },
    Family {
        name: "nginx_redis_ratelimit_conn_leases_expired_total",
        kind: "counter",
        help: "Other holders' leases of the zone's slots that this node found ended unrenewed (a node gone, frozen or cut off) and dropped.",
        of: Of::Zone(|z| one(z.conn_expired)),
    },
    Family {
        name: "nginx_redis_ratelimit_blocks_total",
        kind: "counter",
        help: "Keys a limit with block= blocked on this node after rejecting them (its penalty box).",
        of: Of::Zone(|z| one(z.blocks)),
    },
    Family {
        name: "nginx_redis_ratelimit_blocked_keys",
        kind: "gauge",
        help: "Keys the zone blocks now (by the API, Lua or a block= penalty), as this node sees the fleet's.",
        of: Of::Zone(|z| one(z.blocked_keys)),
    },
    Family {
        name: "nginx_redis_ratelimit_overridden_keys",
        kind: "gauge",
        help: "Keys the zone limits at an overriding rate now (by the API or Lua), as this node sees the fleet's.",
        of: Of::Zone(|z| one(z.overridden_keys)),
    },
    Family {
        name: "nginx_redis_ratelimit_keys",
        kind: "gauge",
        help: "Keys (key and period pairs) in the zone's shared memory.",
        of: Of::Zone(|z| one(z.keys)),
    },
    Family {
        name: "nginx_redis_ratelimit_keys_capacity",
        kind: "gauge",
        help: "Keys the zone's shared memory holds.",
        of: Of::Zone(|z| one(z.capacity)),
    },
    Family {
        name: "nginx_redis_ratelimit_evictions_total",
        kind: "counter",
        help: "Least recently used keys evicted to make room.",
        of: Of::Zone(|z| one(z.evictions)),
    },
    Family {
        name: "nginx_redis_ratelimit_breaker_trips_total",
        kind: "counter",
        help: "Keys whose breaker opened (Redis's counts put the key over its limit: its requests are refused without a look at the counts), once per key and window.",
        of: Of::Zone(|z| one(z.breaker_trips)),
    },
    Family {
        name: "nginx_redis_ratelimit_dropped_increments_total",
        kind: "counter",
        help: "Counted requests the queue to the Redis thread had no room for (counted on this node only).",
        of: Of::Zone(|z| one(z.dropped)),
    },
    Family {
        name: "nginx_redis_ratelimit_backend_up",
        kind: "gauge",
        help: "1 while the zone's Redis backend works, 0 while it is down (as its threads last saw it).",
        of: Of::Redis(|r| one(u64::from(r.up))),
    },
    Family {
        name: "nginx_redis_ratelimit_on_error",
        kind: "gauge",
        help: "The zone's on_error policy (1 for the one in force while Redis is down).",
        of: Of::Redis(|r| vec![(format!(",policy=\"{}\"", r.on_error), "1".into())]),
    },
    Family {
        name: "nginx_redis_ratelimit_redis_nodes",
        kind: "gauge",
        help: "Nodes counting the zone through its Redis lately (on_error=share; 0: not known).",
        of: Of::Redis(|r| one(r.nodes)),
    },
    Family {
        name: "nginx_redis_ratelimit_redis_commands_total",
        kind: "counter",
        help: "Redis commands sent.",
        of: Of::Redis(|r| one(r.commands)),
    },
    Family {
        name: "nginx_redis_ratelimit_redis_pipelines_total",
        kind: "counter",
        help: "Pipelines (flushes, checks, TTL fixes) sent to Redis.",
        of: Of::Redis(|r| one(r.pipelines)),
    },
    Family {
        name: "nginx_redis_ratelimit_redis_errors_total",
        kind: "counter",
        help: "Redis errors: transport (refused, reset, timeout, TLS, cluster down) or reply (an error reply to one command).",
        of: Of::Redis(|r| {
            vec![
                (",kind=\"transport\"".into(), r.errors_transport.to_string()),
                (",kind=\"reply\"".into(), r.errors_reply.to_string()),
            ]
        }),
    },
    Family {
        name: "nginx_redis_ratelimit_redis_connects_total",
        kind: "counter",
        help: "Connections made to Redis.",
        of: Of::Redis(|r| one(r.connects)),
    },
    Family {
        name: "nginx_redis_ratelimit_increments_waiting",
        kind: "gauge",
        help: "Counted requests waiting on this node to be sent to Redis (held far from the limit, or kept through an outage).",
        of: Of::Redis(|r| one(r.waiting)),
    },
    Family {
        name: "nginx_redis_ratelimit_last_sync_age_seconds",
        kind: "gauge",
        help: "Seconds that counts have waited on this node without a flush to Redis going through (since the later of the last flush and the oldest count waiting); 0 while none waits.",
        of: Of::Redis(|r| r.sync_age_s.map(|a| (String::new(), a.to_string())).into_iter().collect()),
    },
    Family {
        name: "nginx_redis_ratelimit_strict_waits_total",
        kind: "counter",
        help: "Requests that waited for Redis's decision (strict limits).",
        of: Of::Redis(|r| one(r.strict_waits)),
    },
    Family {
        name: "nginx_redis_ratelimit_strict_timeouts_total",
        kind: "counter",
        help: "Strict requests whose wait ended without Redis's decision (timeout=, a failed exchange, an error reply): decided by on_error.",
        of: Of::Redis(|r| one(r.strict_timeouts)),
    },
];

/// The Prometheus text exposition of `zones`.
pub fn prometheus(zones: &[Zone]) -> String {
    let mut out = String::new();
    for f in FAMILIES {
        head(&mut out, f.name, f.kind, f.help);
        for z in zones {
            let samples = match (&f.of, &z.redis) {
                (Of::Zone(of), _) => of(z),
                (Of::Redis(of), Some(r)) => of(r),
                (Of::Redis(_), None) => continue,
            };
            for (labels, v) in samples {
                let _ = writeln!(out, "{}{{zone=\"{}\"{labels}}} {v}", f.name, label(&z.name));
            }
        }
    }
    roundtrips(&mut out, zones);
    out
}

/// The histogram of the round trips of each Redis zone's pipelines.
fn roundtrips(out: &mut String, zones: &[Zone]) {
    let name = "nginx_redis_ratelimit_redis_roundtrip_seconds";
    head(out, name, "histogram", "Round trips of the pipelines sent to Redis.");
    for z in zones {
        let Some(rz) = &z.redis else {
            continue;
        };
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
}

/// Whether a query string asks for JSON (`format=json` among its
/// arguments).
pub fn wants_json(args: &[u8]) -> bool {
    args.split(|&b| b == b'&').any(|a| a == b"format=json")
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
             \"delayed\":{},\"conn\":{{\"in_flight\":{},\"rejected\":{},\"rejected_dry_run\":{},\"leased\":{},\"leases_expired\":{}}},\
             \"blocks\":{},\"blocked_keys\":{},\"overridden_keys\":{},\
             \"keys\":{},\"keys_capacity\":{},\"evictions\":{},\"breaker_trips\":{},\
             \"dropped_increments\":{},\"redis\":",
            crate::text::json_string(&z.name),
            z.passed,
            z.rejected,
            z.rejected_dry_run,
            z.not_limited,
            z.delayed,
            z.conn_in_flight,
            z.conn_rejected,
            z.conn_rejected_dry_run,
            z.conn_leased,
            z.conn_expired,
            z.blocks,
            z.blocked_keys,
            z.overridden_keys,
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
