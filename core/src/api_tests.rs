use super::*;

#[test]
fn paths_name_resources_with_percent_encoded_keys() {
    assert_eq!(route(b"/"), Ok(Route::Root));
    assert_eq!(route(b"zones"), Ok(Route::Zones));
    assert_eq!(route(b"/zones/"), Ok(Route::Zones));
    assert_eq!(route(b"zones/login"), Ok(Route::Zone("login".into())));
    assert_eq!(route(b"zones/login/top"), Ok(Route::Top("login".into())));
    assert_eq!(
        route(b"zones/api/keys/a%2Fb%00c"),
        Ok(Route::Key("api".into(), b"a/b\0c".to_vec(), Part::Key))
    );
    assert_eq!(
        route(b"zones/api/keys/k/block"),
        Ok(Route::Key("api".into(), b"k".to_vec(), Part::Block))
    );
    assert_eq!(
        route(b"zones/api/keys/k/override"),
        Ok(Route::Key("api".into(), b"k".to_vec(), Part::Override))
    );
    for bad in [&b"zones/api/keys/k/other"[..], b"zones/api/keys", b"other", b"zones/a/b"] {
        assert_eq!(route(bad).map_err(|p| p.status), Err(404), "{bad:?}");
    }
    let p = route(b"zones/api/keys/%zz").unwrap_err();
    assert_eq!((p.status, p.field), (400, Some("key")));
    assert_eq!(route(b"zones/api/keys/%").unwrap_err().status, 400);
    // a path-like key is a key: only its own bytes
    assert_eq!(
        route(b"zones/api/keys/..%2F..%2Fetc"),
        Ok(Route::Key("api".into(), b"../../etc".to_vec(), Part::Key))
    );
}

#[test]
fn address_keys_are_written_as_text() {
    assert_eq!(key_text(&[192, 0, 2, 1], true), "192.0.2.1");
    assert_eq!(
        key_text(&[192, 0, 2, 1], false),
        "\u{c0}\0\u{2}\u{1}".replace('\u{c0}', "\u{fffd}")
    );
    let v6 = key_bytes(b"2001:db8::1".to_vec(), true).unwrap();
    assert_eq!(v6.len(), 16);
    assert_eq!(key_text(&v6, true), "2001:db8::1");
    assert_eq!(key_bytes(b"10.0.0.1".to_vec(), true).unwrap(), vec![10, 0, 0, 1]);
    assert_eq!(key_bytes(b"host".to_vec(), true).unwrap_err().field, Some("key"));
    assert_eq!(key_bytes(b"host".to_vec(), false).unwrap(), b"host");
}

#[test]
fn bodies_are_read_strictly() {
    let ok = body(br#" {"rate": "1000r/m", "ttl": "1h"} "#, true, None).unwrap();
    assert_eq!(ok.rate, Some(Rate { limit: 1000, period: 60 }));
    assert_eq!(ok.ttl_ms, Some(3_600_000));
    assert_eq!(body(br#"{"ttl":900}"#, false, None).unwrap().ttl_ms, Some(900_000));
    assert_eq!(body(b"{}", false, Some(5000)).unwrap().ttl_ms, Some(5000));
    assert_eq!(body(br#"{"ttl":"1h30m"}"#, false, None).unwrap().ttl_ms, Some(5_400_000));
    let field = |b: &[u8], rate| body(b, rate, None).unwrap_err().field;
    assert_eq!(field(br#"{"rate":"fast","ttl":"1h"}"#, true), Some("rate"));
    assert_eq!(field(br#"{"rate":1000,"ttl":"1h"}"#, true), Some("rate"));
    assert_eq!(field(br#"{"ttl":"1h"}"#, true), Some("rate"));
    assert_eq!(field(br#"{"rate":"1r/s"}"#, true), Some("ttl"));
    assert_eq!(field(br#"{"ttl":"31d"}"#, false), Some("ttl"));
    assert_eq!(field(br#"{"ttl":"0s"}"#, false), Some("ttl"));
    assert_eq!(field(br#"{"ttl":"-5"}"#, false), Some("ttl"));
    assert_eq!(field(br#"{"ttl":"5 m"}"#, false), Some("ttl"));
    assert_eq!(field(br#"{"ttl":99999999999999999999}"#, false), Some("body"));
    assert_eq!(field(br#"{"ttl":"1h","rate":"1r/s"}"#, false), Some("body"));
    assert_eq!(field(br#"{"ttl":"1h","ttl":"2h"}"#, false), Some("body"));
    for garbage in [
        &b""[..],
        b"{",
        b"[]",
        b"null",
        b"{\"ttl\":\"1h\"} x",
        b"{\"ttl\" \"1h\"}",
        b"{'ttl':'1h'}",
        b"{\"ttl\":\"1h\",}",
        b"\xff\xfe",
        b"{\"t\xfftl\":1}",
        b"{\"ttl\":\"\\u12\"}",
    ] {
        assert_eq!(field(garbage, false), Some("body"), "{garbage:?}");
    }
    assert_eq!(body(&vec![b' '; MAX_BODY + 1], false, None).unwrap_err().status, 413);
    assert_eq!(
        body(br#"{"rate":"5r\/s","ttl":"\u0031h"}"#, true, None).unwrap(),
        Body { rate: Some(Rate { limit: 5, period: 1 }), ttl_ms: Some(3_600_000) }
    );
}

#[test]
fn top_takes_n_within_bounds() {
    assert_eq!(top_n(b""), Ok(20));
    assert_eq!(top_n(b"n=5&x=1"), Ok(5));
    for bad in [&b"n=0"[..], b"n=65", b"n=-1", b"n=", b"n=1e3", b"n=99999999999999999999"] {
        assert_eq!(top_n(bad).unwrap_err().field, Some("n"), "{bad:?}");
    }
}

#[test]
fn problems_name_the_field() {
    let p = Problem::new(400, Some("ttl"), "is required");
    assert_eq!(
        p.body(),
        "{\"type\":\"about:blank\",\"title\":\"Bad Request\",\"status\":400,\"detail\":\"is required\",\"invalid-params\":[{\"name\":\"ttl\",\"reason\":\"is required\"}]}\n"
    );
    assert!(!Problem::new(404, None, "no such zone").body().contains("invalid-params"));
}
