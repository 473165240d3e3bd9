//! Unit tests of `params.rs`.
use super::*;

const MIN: usize = 8 * 4096;

/// Stand-in for `ngx_parse_size`: `1024`, `10k`, `32m`, `1g`.
fn size(s: &[u8]) -> Option<usize> {
    let (num, scale) = match s.last()? {
        b'k' | b'K' => (&s[..s.len() - 1], 1usize << 10),
        b'm' | b'M' => (&s[..s.len() - 1], 1 << 20),
        b'g' | b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    if num.is_empty() || !num.iter().all(u8::is_ascii_digit) || num.len() > 12 {
        return None;
    }
    std::str::from_utf8(num).ok()?.parse::<usize>().ok()?.checked_mul(scale)
}

/// `ngx_parse_time`'s syntax (`100ms`, `2s`, `1m30s`, `1h`, `1d`; a bare
/// number is seconds), as the API reads it.
const UNITS: Units = Units { size, time_ms: crate::api::time_ms };

fn parse(s: &str) -> Result<ZoneParams, String> {
    let args: Vec<&[u8]> = s.split_whitespace().map(str::as_bytes).collect();
    parse_zone_params(&args, MIN, UNITS)
}

#[test]
fn local_zone() {
    let p = parse("zone=login:10m").unwrap();
    assert_eq!(p.name, "login");
    assert_eq!(p.size, 10 << 20);
    assert_eq!(p.backend, None);
    assert_eq!(p.prefix, b"rl:");
    assert_eq!(p.on_error, OnError::Local);
}

#[test]
fn redis_zone_with_everything() {
    let p = parse(
        "zone=api:32m redis=redis://10.0.0.1:7000,redis://10.0.0.2:7000 cluster \
         on_error=deny timeout=100ms prefix=app:",
    )
    .unwrap();
    let b = p.backend.unwrap();
    assert!(b.cluster);
    assert_eq!(b.urls.len(), 2);
    assert_eq!(p.on_error, OnError::Deny);
    assert_eq!(p.timeout_ms, 100);
    assert_eq!(p.hold_ms, DEFAULT_HOLD_MS);
    assert_eq!(parse("zone=a:1m redis=redis://h:1 hold=0").map(|p| p.hold_ms), Ok(0));
    assert_eq!(p.nodes, 1, "no floor");
    let share = "zone=a:1m redis=redis://h:1 on_error=share nodes=12";
    assert_eq!(parse(share).map(|p| p.nodes), Ok(12));
    assert_eq!(parse("zone=a:1m redis=redis://h:1 hold=250ms").map(|p| p.hold_ms), Ok(250));
    assert_eq!(p.prefix, b"app:");
    assert!(parse("zone=a:1m redis=rediss://u:p@h:6380/2").is_ok());
    assert!(parse("zone=a:1m redis=redis+unix:///tmp/redis.sock").is_ok());
    let s = parse("zone=a:1m redis=redis://s1:26379,redis://:pw@s2:26379 sentinel=mymaster")
        .unwrap()
        .backend
        .unwrap();
    let sentinel = s.sentinel.as_ref().expect("sentinel");
    assert_eq!(sentinel.master, "mymaster");
    assert_eq!((sentinel.user.as_deref(), sentinel.password.as_deref()), (None, None));
    let p = parse(
        "zone=a:1m redis=redis://s1:26379 sentinel=m sentinel_user=watch sentinel_password=a:b@c",
    )
    .expect("sentinel credentials");
    let sentinel = p.backend.and_then(|b| b.sentinel).expect("sentinel");
    assert_eq!(sentinel.user.as_deref(), Some("watch"));
    assert_eq!(sentinel.password.as_deref(), Some("a:b@c"));
    assert!(!format!("{sentinel:?}").contains("a:b@c"));
    assert!(!s.cluster);
    assert_eq!(s.urls.len(), 2);
}

#[test]
fn refusals_name_the_value() {
    for (conf, needle) in [
        ("", "zone=name:size"),
        ("zone=a", "zone=a"),
        ("zone=:1m", "invalid zone name"),
        ("zone=a:1q", "\"1q\""),
        ("zone=a:1k", "too small"),
        ("zone=a:1m zone=b:1m", "duplicate"),
        ("zone=a:1m bogus=1", "\"bogus=1\""),
        ("zone=a:1m clustr", "\"clustr\""),
        ("zone=a:1m redis=http://x:1", "\"http://x:1\""),
        ("zone=a:1m redis=redis://h:notaport", "notaport"),
        ("zone=a:1m redis=redis://a:1,redis://b:2", "cluster"),
        ("zone=a:1m cluster", "cluster"),
        ("zone=a:1m redis=redis://h:1 on_error=maybe", "\"maybe\""),
        ("zone=a:1m redis=redis://h:1 timeout=-1", "\"-1\""),
        ("zone=a:1m redis=redis://h:1 timeout=0", "\"0\""),
        (
            "zone=a:1m redis=redis://h:1 timeout=61s",
            "invalid timeout \"61s\": a time from 1ms to 60s",
        ),
        ("zone=a:1m redis=redis://h:1 timeout=9223372036854775807ms", "\"9223372036854775807ms\""),
        ("zone=a:1m redis=redis://h:1 prefix=a{b", "a{b"),
        ("zone=a:1m timeout=1s", "timeout="),
        ("zone=a:1m redis=redis://h:1 hold=-1", "invalid hold \"-1\""),
        ("zone=a:1m redis=redis://h:1 hold=61s", "invalid hold \"61s\""),
        ("zone=a:1m redis=redis://h:1 hold=1s hold=2s", "hold"),
        ("zone=a:1m hold=1s", "\"hold=\" needs"),
        ("zone=a:1m redis=redis://h:1 on_error=share nodes=0", "invalid nodes \"0\""),
        ("zone=a:1m redis=redis://h:1 on_error=share nodes=-2", "invalid nodes \"-2\""),
        ("zone=a:1m redis=redis://h:1 on_error=share nodes=+2", "invalid nodes \"+2\""),
        ("zone=a:1m redis=redis://h:1 on_error=share nodes=100001", "from 1 to 100000"),
        ("zone=a:1m redis=redis://h:1 on_error=share nodes=2 nodes=3", "duplicate"),
        ("zone=a:1m redis=redis://h:1 nodes=4", "\"nodes=\" needs \"on_error=share\""),
        ("zone=a:1m redis=redis://h:1 on_error=local nodes=4", "needs \"on_error=share\""),
        ("zone=a:1m nodes=4", "\"nodes=\" needs \"redis=URL\""),
        ("zone=a:b:1m", "invalid zone name \"a:b\""),
        ("zone=a{b}:1m", "a{b}"),
        ("zone=a:1m sentinel=m", "\"sentinel=\" needs"),
        ("zone=a:1m redis=redis://h:1 sentinel=", "invalid sentinel \"\""),
        ("zone=a:1m redis=redis://h:1 sentinel=m sentinel=n", "duplicate"),
        ("zone=a:1m redis=redis://h:1,redis://h:2 cluster sentinel=m", "exclude"),
        ("zone=a:1m redis=redis://h:1 sentinel_password=x", "need \"sentinel=\""),
        ("zone=a:1m redis=redis://h:1 sentinel=m sentinel_user=u", "needs \"sentinel_password=\""),
        ("zone=a:1m redis=redis://h:1 sentinel=m sentinel_password=", "invalid sentinel_password"),
        (
            "zone=a:1m redis=redis://h:1 sentinel=m sentinel_password=a sentinel_password=b",
            "duplicate",
        ),
        ("zone=a:1m sentinel_password=x", "\"sentinel=\" needs"),
    ] {
        let err = parse(conf).expect_err(conf);
        assert!(err.contains(needle), "{conf}: {err}");
    }
}

#[test]
fn passwords_never_shown() {
    assert_eq!(redact("redis://user:s3cret@h:1/0"), "redis://user:***@h:1/0");
    assert_eq!(redact("redis://:s3cret@h:1"), "redis://:***@h:1");
    assert_eq!(redact("redis://h:1"), "redis://h:1");
    let err = parse("zone=a:1m redis=redis://u:s3cret@h:notaport").unwrap_err();
    assert!(!err.contains("s3cret"), "{err}");
    let err = parse("zone=a:1m redis=http://u:s3cret@h:1").unwrap_err();
    assert!(!err.contains("s3cret"), "{err}");
    // whatever bytes the password holds, as typed
    for pass in ["se/cr#et?x@y%zz", "a/b", "#x", "?q", "@@", "p%2Fss", "x@h:1/"] {
        for url in [
            format!("redis://user:{pass}@127.0.0.1:6379/0"),
            format!("redis://:{pass}@127.0.0.1:6379"),
            format!("rediss://{pass}@h:1"),
        ] {
            let shown = redact(&url);
            assert!(!shown.contains(pass), "{url} -> {shown}");
            assert!(
                shown.ends_with("@127.0.0.1:6379/0")
                    || shown.ends_with("@127.0.0.1:6379")
                    || shown.ends_with("@h:1"),
                "{shown}"
            );
            let err = parse(&format!("zone=a:1m redis={url} bogus")).unwrap_err();
            assert!(!err.contains(pass), "{err}");
            let err = parse(&format!("zone=a:1m redis={url},redis://h:2")).unwrap_err();
            assert!(!err.contains(pass), "{err}");
        }
        assert_eq!(url_password(&format!("redis://u:{pass}@h:1")), Some(pass));
    }
    // percent-encoded passwords are decoded by the URL parser
    assert!(parse("zone=a:1m redis=redis://:p%2Fss@127.0.0.1:6379").is_ok());
    // a "%" that starts no escape is refused, the password not shown
    for url in ["redis://:pa%zzss@h:1", "redis://u%:pw@h:1", "redis://:pw%4@h:1", "redis://:%@h:1"]
    {
        let err = parse(&format!("zone=a:1m redis={url}")).unwrap_err();
        assert!(err.contains("not followed by two hex digits"), "{url}: {err}");
        assert!(!err.contains("pa%zz") && !err.contains("pw%4"), "{err}");
    }
    assert!(parse("zone=a:1m redis=redis://:100%25@h:1").is_ok());
}

#[test]
fn a_sentinel_password_is_never_shown() {
    for conf in [
        "zone=a:1m redis=redis://h:1 sentinel=m sentinel_pasword=hunter2",
        "zone=a:1m redis=redis://h:1 sentinel=m sentinel_password=hunter2 sentinel_password=hunter2",
        "zone=a:1m redis=redis://h:1 sentinel_password=hunter2",
        "zone=a:1m redis=redis://h:1 Password=hunter2",
    ] {
        let err = parse(conf).expect_err(conf);
        assert!(!err.contains("hunter2"), "{conf}: {err}");
    }
}

#[test]
fn a_password_file_goes_into_every_url() {
    let mut p = parse("zone=a:1m redis=redis://h1:7000,redis://[::1]:7001 cluster password_file=x")
        .unwrap();
    assert_eq!(p.password_file.as_deref(), Some(&b"x"[..]));
    with_password_file(&mut p, b"s3cr/t@:pw\n").unwrap();
    let urls = &p.backend.as_ref().unwrap().urls;
    assert_eq!(urls[0], "redis://:s3cr%2Ft%40%3Apw@h1:7000");
    assert_eq!(urls[1], "redis://:s3cr%2Ft%40%3Apw@[::1]:7001");
    for u in urls {
        let ci = u.as_str().into_connection_info().unwrap();
        assert_eq!(ci.redis_settings().password(), Some("s3cr/t@:pw"));
    }

    let mut p = parse("zone=a:1m redis=rediss://h:6380/2 password_file=x").unwrap();
    with_password_file(&mut p, b"app\r\npass word\r\n").unwrap();
    let ci = p.backend.as_ref().unwrap().urls[0].as_str().into_connection_info().unwrap();
    assert_eq!(ci.redis_settings().username(), Some("app"));
    assert_eq!(ci.redis_settings().password(), Some("pass word"));
    assert_eq!(ci.redis_settings().db(), 2);

    let mut p = parse("zone=a:1m redis=redis+unix:///run/redis.sock password_file=x").unwrap();
    with_password_file(&mut p, b"u\np&q").unwrap();
    let ci = p.backend.as_ref().unwrap().urls[0].as_str().into_connection_info().unwrap();
    assert_eq!(ci.redis_settings().password(), Some("p&q"));
    assert_eq!(ci.redis_settings().username(), Some("u"));
}

#[test]
fn a_password_file_is_refused_without_showing_it() {
    for (conf, contents, needle) in [
        ("zone=a:1m redis=redis://h:1 password_file=x", &b""[..], "one line"),
        ("zone=a:1m redis=redis://h:1 password_file=x", b"\n\n", "one line"),
        ("zone=a:1m redis=redis://h:1 password_file=x", b"a\nb\nhunter2", "one line"),
        ("zone=a:1m redis=redis://h:1 password_file=x", b"\nhunter2", "one line"),
        ("zone=a:1m redis=redis://h:1 password_file=x", b"\xffhunter2", "UTF-8"),
        (
            "zone=a:1m redis=redis://:0ld-pw@h:1 password_file=x",
            b"hunter2",
            "credentials of its own",
        ),
    ] {
        let mut p = parse(conf).unwrap();
        let err = with_password_file(&mut p, contents).expect_err(conf);
        assert!(err.contains(needle), "{conf}: {err}");
        assert!(!err.contains("hunter2") && !err.contains("0ld-pw"), "{err}");
    }
    assert!(parse("zone=a:1m password_file=x").unwrap_err().contains("needs \"redis=URL\""));
    assert!(parse("zone=a:1m redis=redis://h:1 password_file=")
        .unwrap_err()
        .contains("a file name"));
}
