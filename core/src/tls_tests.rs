use super::*;

/// An EC certificate made with `openssl req -x509 -days 3650`:
/// notBefore 2026-11-27 02:44:51 UTC, notAfter 2036-11-24 02:44:51 UTC.
const CERT_HEX: [&str; 10] = [
    "3082016d30820113a00302010202141594a4bcb2c1f23964819680109797a3444b0123300a06082a",
    "8648ce3d040302300c310a300806035504030c0174301e170d3236313132373032343435315a170d",
    "3336313132343032343435315a300c310a300806035504030c01743059301306072a8648ce3d0201",
    "06082a8648ce3d03010703420004a3c28aaaf041e917a190f745af8b780d66c676235ad8deb6c4b3",
    "b11f89bbcacc56aee56ed3337e744c8cc79be6b8b1c63812ed31a2f5970b659093f2bc6333efa353",
    "3051301d0603551d0e04160414c6b78b1031556409f2edb09f8f6be808097d7a83301f0603551d23",
    "041830168014c6b78b1031556409f2edb09f8f6be808097d7a83300f0603551d130101ff04053003",
    "0101ff300a06082a8648ce3d0403020348003045022100ee7284f15729bbcf47d2383b23b666bbac",
    "fb7866d18cdcaf5d960197f3a352d402206ca92a0ba5ba6940c951e9d2dd099b7b2b6f5e785d7849",
    "38b76e2357975a973e",
];

fn cert() -> Vec<u8> {
    let hex: String = CERT_HEX.concat();
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn a_real_certificate_s_validity_is_read() {
    // `date -d "2026-11-27 02:44:51 UTC" +%s` and the same for 2036-11-24
    assert_eq!(validity(&cert()), Some((1_795_747_491, 2_111_107_491)));
    assert_eq!(utc(1_795_747_491), "2026-11-27 02:44:51 UTC");
    assert_eq!(utc(2_111_107_491), "2036-11-24 02:44:51 UTC");
    assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
    assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
}

/// SEQ { SEQ { serial, signature, issuer, validity } } without a version,
/// with a long-form length, GeneralizedTime and a UTCTime from the 1900s.
#[test]
fn generalized_times_and_version_one_certificates() {
    let mut validity_el = vec![0x30, 32];
    validity_el.extend([0x17, 13]);
    validity_el.extend(b"991231235959Z");
    validity_el.extend([0x18, 15]);
    validity_el.extend(b"20500101000000Z");
    let mut tbs_body = vec![0x02, 1, 7, 0x30, 0, 0x30, 0];
    tbs_body.extend(&validity_el);
    let mut tbs = vec![0x30, 0x81, tbs_body.len() as u8];
    tbs.extend(&tbs_body);
    let mut cert = vec![0x30, tbs.len() as u8];
    cert.extend(&tbs);
    let (from, until) = validity(&cert).unwrap();
    assert_eq!(version(&cert), Some(1));
    assert_eq!(version(&self::cert()), Some(3), "openssl req -x509 makes v3");
    assert_eq!(utc(from), "1999-12-31 23:59:59 UTC");
    assert_eq!(utc(until), "2050-01-01 00:00:00 UTC");
}

#[test]
fn what_is_not_a_certificate_gives_none() {
    let c = cert();
    assert_eq!(validity(&[]), None);
    assert_eq!(version(&[]), None);
    assert_eq!(version(&c[..40]), None);
    assert_eq!(validity(b"-----BEGIN CERTIFICATE-----"), None);
    for cut in [1, 10, 40, 60, 80] {
        assert_eq!(validity(&c[..cut]), None, "cut at {cut}");
    }
    // a month 13
    let mut bad = c.clone();
    let at = bad.windows(13).position(|w| w == b"261127024451Z").unwrap();
    bad[at + 2] = b'1';
    bad[at + 3] = b'3';
    assert_eq!(validity(&bad), None);
}

fn params(pairs: &[(&str, &str)]) -> Result<SslParams, String> {
    let mut p = SslParams::default();
    for (n, v) in pairs {
        assert!(p.take(n.as_bytes(), v.as_bytes())?, "{n} not taken");
    }
    Ok(p)
}

#[test]
fn ssl_parameters_are_taken_and_checked() {
    let urls = |u: &[&str]| u.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let p = params(&[("ssl_certificate", "c.pem"), ("ssl_certificate_key", "k.pem")]).unwrap();
    assert_eq!(p.certificate.as_deref(), Some(&b"c.pem"[..]));
    assert!(p.check(Some(&urls(&["rediss://h:6380"])), false).is_ok());
    // a client certificate beside #insecure: sent, the server not verified
    assert!(p.check(Some(&urls(&["rediss://h:6380/#insecure"])), true).is_ok());
    let ca = params(&[("ssl_trusted_certificate", "ca.pem")]).unwrap();
    assert!(ca.check(Some(&urls(&["redis://s1:26379", "rediss://s2:26379"])), false).is_ok());
    assert!(SslParams::default().check(None, true).is_ok());
    assert!(!SslParams::default().take(b"ssl_names", b"x").unwrap());
    let named = params(&[("ssl_name", "redis.internal")]).unwrap();
    assert_eq!(named.name.as_deref(), Some("redis.internal"));
    assert!(named.check(Some(&urls(&["rediss://10.0.0.5:6380"])), false).is_ok());
    let e = named.check(Some(&urls(&["rediss://10.0.0.5:6380"])), true).unwrap_err();
    assert!(e.contains("does not apply to \"cluster\""), "{e}");
    let e = named.check(Some(&urls(&["rediss://10.0.0.5:6380/#insecure"])), false).unwrap_err();
    assert!(e.contains("\"ssl_name=\" verifies the server"), "{e}");
    assert!(named
        .check(Some(&urls(&["redis://10.0.0.5:6379"])), false)
        .unwrap_err()
        .contains("TLS URL"));
    assert!(params(&[("ssl_name", "a b")]).is_err());

    type Case<'a> = (&'a [(&'a str, &'a str)], Option<&'a [&'a str]>, &'a str);
    let refused: [Case; 6] = [
        (&[("ssl_certificate", "c")], Some(&["rediss://h:1"]), "needs \"ssl_certificate_key=\""),
        (&[("ssl_certificate_key", "k")], Some(&["rediss://h:1"]), "needs \"ssl_certificate=\""),
        (&[("ssl_trusted_certificate", "ca")], None, "needs \"redis=URL\""),
        (&[("ssl_trusted_certificate", "ca")], Some(&["redis://h:1"]), "needs a TLS URL"),
        (
            &[("ssl_trusted_certificate", "ca")],
            Some(&["rediss://h:1/#insecure"]),
            "turns verification off",
        ),
        (
            &[("ssl_certificate", "c"), ("ssl_certificate_key", "k")],
            Some(&["unix:///run/r.sock"]),
            "needs a TLS URL",
        ),
    ];
    for (pairs, u, want) in refused {
        let p = params(pairs).unwrap();
        let e = p.check(u.map(urls).as_deref(), false).unwrap_err();
        assert!(e.contains(want), "{pairs:?} {u:?}: {e}");
    }
    assert!(params(&[("ssl_certificate", "a"), ("ssl_certificate", "b")])
        .unwrap_err()
        .contains("duplicate"));
    assert!(params(&[("ssl_certificate_key", "")]).unwrap_err().contains("a file name expected"));
}

#[test]
fn tls_files_never_show_their_contents() {
    let f = TlsFiles {
        trusted: None,
        certificate: Some(b"CERT".to_vec()),
        key: Some(b"SECRET KEY".to_vec()),
        name: None,
    };
    let shown = format!("{f:?}");
    assert!(!shown.contains("SECRET") && !shown.contains("CERT\""), "{shown}");
    assert!(shown.contains("key: \"set\""), "{shown}");
}
