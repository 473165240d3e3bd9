//! Unit tests of `metrics.rs`.
use super::*;

fn zones() -> Vec<Zone> {
    let mut rtt = vec![0; RTT_BUCKETS_US.len() + 1];
    rtt[0] = 5;
    rtt[2] = 1;
    vec![
        Zone {
            name: "login".into(),
            passed: 10,
            rejected: 3,
            keys: 7,
            capacity: 15_742,
            breaker_trips: 2,
            delayed: 4,
            conn_in_flight: 5,
            conn_rejected: 6,
            redis: Some(Redis {
                up: true,
                on_error: "local",
                commands: 20,
                pipelines: 6,
                errors_reply: 1,
                connects: 1,
                sync_age_s: Some(0.25),
                rtt_buckets: rtt,
                rtt_sum_us: 4_000,
                ..Redis::default()
            }),
            ..Zone::default()
        },
        Zone { name: "e\"dge\\".into(), passed: 1, ..Zone::default() },
    ]
}

#[test]
fn prometheus_text_has_help_type_and_one_sample_per_zone() {
    let t = prometheus(&zones());
    for want in [
        "# TYPE nginx_redis_ratelimit_requests_total counter\n",
        "nginx_redis_ratelimit_requests_total{zone=\"login\",outcome=\"passed\"} 10\n",
        "nginx_redis_ratelimit_requests_total{zone=\"login\",outcome=\"rejected\"} 3\n",
        "nginx_redis_ratelimit_keys{zone=\"login\"} 7\n",
        "nginx_redis_ratelimit_keys_capacity{zone=\"login\"} 15742\n",
        "nginx_redis_ratelimit_breaker_trips_total{zone=\"login\"} 2\n",
        "nginx_redis_ratelimit_delayed_total{zone=\"login\"} 4\n",
        "# TYPE nginx_redis_ratelimit_conn_in_flight gauge\n",
        "nginx_redis_ratelimit_conn_in_flight{zone=\"login\"} 5\n",
        "nginx_redis_ratelimit_conn_rejected_total{zone=\"login\",outcome=\"rejected\"} 6\n",
        "nginx_redis_ratelimit_backend_up{zone=\"login\"} 1\n",
        "nginx_redis_ratelimit_on_error{zone=\"login\",policy=\"local\"} 1\n",
        "nginx_redis_ratelimit_redis_commands_total{zone=\"login\"} 20\n",
        "nginx_redis_ratelimit_redis_errors_total{zone=\"login\",kind=\"reply\"} 1\n",
        "nginx_redis_ratelimit_last_sync_age_seconds{zone=\"login\"} 0.25\n",
        "nginx_redis_ratelimit_redis_roundtrip_seconds_bucket{zone=\"login\",le=\"0.0005\"} 5\n",
        "nginx_redis_ratelimit_redis_roundtrip_seconds_bucket{zone=\"login\",le=\"0.001\"} 5\n",
        "nginx_redis_ratelimit_redis_roundtrip_seconds_bucket{zone=\"login\",le=\"0.002\"} 6\n",
        "nginx_redis_ratelimit_redis_roundtrip_seconds_bucket{zone=\"login\",le=\"+Inf\"} 6\n",
        "nginx_redis_ratelimit_redis_roundtrip_seconds_sum{zone=\"login\"} 0.004\n",
        "nginx_redis_ratelimit_redis_roundtrip_seconds_count{zone=\"login\"} 6\n",
        // label values escaped
        "{zone=\"e\\\"dge\\\\\",outcome=\"passed\"} 1\n",
    ] {
        assert!(t.contains(want), "missing {want:?} in\n{t}");
    }
    // a zone without Redis has no backend samples
    assert!(!t.contains("nginx_redis_ratelimit_backend_up{zone=\"e"));
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
    assert!(j.starts_with("{\"zones\":{\"login\":{\"requests\":{\"passed\":10,\"rejected\":3,"));
    assert!(j.contains("\"rejected_dry_run\":0,\"not_limited\":0},"));
    assert!(j.contains("\"keys\":7,\"keys_capacity\":15742,\"evictions\":0,\"breaker_trips\":2,"));
    assert!(j.contains("\"redis\":{\"up\":true,\"on_error\":\"local\",\"commands\":20,"));
    assert!(j.contains("\"last_sync_age_seconds\":0.25,"));
    assert!(j.contains("\"roundtrip_counts\":[5,0,1,0,0,0,0,0,0,0,0,0]"));
    assert!(j.contains("\"e\\\"dge\\\\\":{\"requests\":{\"passed\":1,"));
    assert!(j.contains("\"redis\":null}"));
    assert_eq!(json(&[]), "{\"zones\":{}}\n");
}
