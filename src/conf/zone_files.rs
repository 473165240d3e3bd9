//! The files a zone's parameters name, read when the configuration is
//! (so a reload reads them again): `password_file=` and the `ssl_*=`
//! certificates and key. What they hold is checked here, so that a file
//! that cannot work fails `nginx -t` rather than every connection later:
//! unreadable, not PEM, a key that is not the certificate's, a certificate
//! out of its validity. Messages name the parameter and the file, never
//! what the file holds.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::{SystemTime, UNIX_EPOCH};

use nginx_sys::ngx_conf_t;
use ratelimit_core::params::{self, ZoneParams};
use ratelimit_core::tls::{self, TlsFiles};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// Why a zone's files were refused: a message for `[emerg]`, or nothing
/// when nginx has logged the reason already.
pub type Refusal = Option<String>;

/// One file, read: its full name (for messages) and contents.
struct Read {
    shown: String,
    contents: Vec<u8>,
}

/// Reads file `name` of parameter `param`, relative to the configuration
/// prefix.
///
/// # Safety
/// `cf` is the configuration being read.
unsafe fn read(cf: *mut ngx_conf_t, param: &str, name: &[u8]) -> Result<Read, Refusal> {
    // SAFETY: the caller's.
    let path = unsafe { crate::conf::full_name(cf, name) }.ok_or(None)?;
    let shown = String::from_utf8_lossy(&path).into_owned();
    match std::fs::read(OsStr::from_bytes(&path)) {
        Ok(contents) => Ok(Read { shown, contents }),
        Err(e) => Err(Some(format!("cannot read {param} \"{shown}\": {e}"))),
    }
}

/// Reads every file `p` names and puts what they hold into its backend.
///
/// # Safety
/// `cf` is the configuration being read.
pub unsafe fn load(cf: *mut ngx_conf_t, p: &mut ZoneParams) -> Result<(), Refusal> {
    if let Some(file) = p.password_file.clone() {
        // SAFETY: the caller's.
        let f = unsafe { read(cf, "password_file", &file) }?;
        params::with_password_file(p, &f.contents)
            .map_err(|e| Some(format!("password_file \"{}\": {e}", f.shown)))?;
    }
    if !p.ssl.any() {
        return Ok(());
    }
    let ssl = p.ssl.clone();
    let mut files = TlsFiles::default();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    if let Some(name) = &ssl.trusted_certificate {
        // SAFETY: the caller's.
        let f = unsafe { read(cf, "ssl_trusted_certificate", name) }?;
        let certs = certificates(&f, "ssl_trusted_certificate", now, false)?;
        let mut store = rustls::RootCertStore::empty();
        for (i, c) in certs.into_iter().enumerate() {
            store.add(c).map_err(|e| {
                Some(format!(
                    "ssl_trusted_certificate \"{}\": certificate {} cannot be a CA: {e}",
                    f.shown,
                    i + 1
                ))
            })?;
        }
        files.trusted = Some(f.contents);
    }
    if let (Some(cert), Some(key)) = (&ssl.certificate, &ssl.certificate_key) {
        // SAFETY: the caller's.
        let c = unsafe { read(cf, "ssl_certificate", cert) }?;
        // SAFETY: the caller's.
        let k = unsafe { read(cf, "ssl_certificate_key", key) }?;
        let chain = certificates(&c, "ssl_certificate", now, true)?;
        let der = PrivateKeyDer::from_pem_slice(&k.contents).map_err(|_| {
            Some(format!(
                "ssl_certificate_key \"{}\": no unencrypted private key in PEM \
                 (PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY)",
                k.shown
            ))
        })?;
        let signing = rustls::crypto::ring::sign::any_supported_type(&der).map_err(|_| {
            Some(format!("ssl_certificate_key \"{}\": a key type TLS cannot sign with", k.shown))
        })?;
        // the key's public half against the certificate's; a key that
        // cannot tell its public half is left to the handshake
        if let Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) =
            rustls::sign::CertifiedKey::new(chain, signing).keys_match()
        {
            return Err(Some(format!(
                "ssl_certificate_key \"{}\" is not the key of ssl_certificate \"{}\"",
                k.shown, c.shown
            )));
        }
        files.certificate = Some(c.contents);
        files.key = Some(k.contents);
    }
    if let Some(name) = &ssl.name {
        if ServerName::try_from(name.as_str()).is_err() {
            return Err(Some(format!(
                "invalid ssl_name \"{name}\": a host name or IP address expected"
            )));
        }
        files.name = Some(name.clone());
    }
    if let Some(b) = p.backend.as_mut() {
        b.tls = Some(files);
    }
    Ok(())
}

/// The PEM certificates in a file. In a client's chain each must be within
/// its validity at `now`; in a CA bundle one is enough (a system bundle
/// often keeps a root past its end).
fn certificates(
    f: &Read,
    param: &str,
    now: i64,
    chain: bool,
) -> Result<Vec<CertificateDer<'static>>, Refusal> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&f.contents)
        .collect::<Result<_, _>>()
        .map_err(|_| Some(format!("{param} \"{}\": not PEM certificates", f.shown)))?;
    if certs.is_empty() {
        return Err(Some(format!("{param} \"{}\": no PEM certificate in it", f.shown)));
    }
    let mut refusal = None;
    let mut valid = 0;
    for (i, c) in certs.iter().enumerate() {
        let which =
            if certs.len() > 1 { format!(" (certificate {})", i + 1) } else { String::new() };
        let Some((from, until)) = tls::validity(c) else {
            return Err(Some(format!("{param} \"{}\"{which}: not an X.509 certificate", f.shown)));
        };
        if chain && tls::version(c) != Some(3) {
            return Err(Some(format!(
                "{param} \"{}\"{which} is an X.509 v{} certificate, which TLS refuses in a \
                 client's chain: make it v3 (openssl x509 -req ... -extfile with a line \
                 \"basicConstraints=CA:FALSE\")",
                f.shown,
                tls::version(c).unwrap_or(1)
            )));
        }
        let why = if until < now {
            format!("{param} \"{}\"{which} expired on {}", f.shown, tls::utc(until))
        } else if from > now {
            format!("{param} \"{}\"{which} is not valid before {}", f.shown, tls::utc(from))
        } else {
            valid += 1;
            continue;
        };
        if chain {
            return Err(Some(why));
        }
        refusal.get_or_insert(why);
    }
    match refusal {
        Some(why) if valid == 0 => Err(Some(why)),
        _ => Ok(certs),
    }
}
