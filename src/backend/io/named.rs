//! A TLS connection that verifies, and sends as SNI, a name of the zone's
//! (`ssl_name=`) rather than the address it connects to: the URL, or a
//! sentinel's answer, may give an IP address while the server's
//! certificate names a host. The `redis` crate ties the name to the
//! address, so this connection is made here (rustls over a `TcpStream`)
//! and speaks through the crate's `ConnectionLike`, as its own does.
//!
//! `Wire` is a connection of either kind: the crate's, or this one.

use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use redis::{ConnectionAddr, ConnectionLike, RedisError, RedisResult, Value};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// The zone's TLS settings beyond the URL: its certificates (`ssl_*=`),
/// and the name every TLS connection verifies (`ssl_name=`).
#[derive(Clone, Debug, Default)]
pub struct Tls {
    pub certs: Option<redis::TlsCertificates>,
    pub name: Option<String>,
}

/// A connection of either kind.
pub enum Wire {
    Crate(redis::Connection),
    Named(Box<Named>),
}

/// The name-verifying TLS connection.
pub struct Named {
    stream: rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
    parser: redis::Parser,
    db: i64,
    open: bool,
}

/// A transport error reading `what: detail` (as the crate's own TLS
/// errors read, without a kind in the middle).
fn io_error(what: &str, detail: String) -> RedisError {
    RedisError::from(std::io::Error::other(format!("{what}: {detail}")))
}

/// The client configuration: the CAs of `ssl_trusted_certificate=` or the
/// system's, and the client certificate if there is one.
fn config(certs: Option<&redis::TlsCertificates>) -> RedisResult<rustls::ClientConfig> {
    let bad = |e: String| io_error("TLS settings", e);
    let mut roots = rustls::RootCertStore::empty();
    match certs.and_then(|c| c.root_cert.as_ref()) {
        Some(pem) => {
            for c in CertificateDer::pem_slice_iter(pem) {
                roots.add(c.map_err(|e| bad(e.to_string()))?).map_err(|e| bad(e.to_string()))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for c in found.certs {
                // a system certificate rustls cannot use is left out
                let _ = roots.add(c);
            }
        }
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    match certs.and_then(|c| c.client_tls.as_ref()) {
        Some(client) => {
            let chain = CertificateDer::pem_slice_iter(&client.client_cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(e.to_string()))?;
            let key = PrivateKeyDer::from_pem_slice(&client.client_key)
                .map_err(|e| bad(e.to_string()))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| bad(e.to_string()))
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

impl Named {
    /// Connects to `host:port` within `timeout` (each address it resolves
    /// to in turn), verifying `name`; reads and writes are bounded by
    /// `timeout` after. Authenticates and selects the database as `ci`
    /// says, as the crate's connections do.
    pub fn connect(
        ci: &redis::ConnectionInfo,
        tls: &Tls,
        name: &str,
        timeout: Duration,
    ) -> RedisResult<Named> {
        let (host, port) = match ci.addr() {
            ConnectionAddr::TcpTls { host, port, .. } => (host.as_str(), *port),
            _ => return Err(io_error("ssl_name", "needs a TLS address".into())),
        };
        let server = ServerName::try_from(name.to_string())
            .map_err(|e| io_error("ssl_name", e.to_string()))?;
        let conn = rustls::ClientConnection::new(Arc::new(config(tls.certs.as_ref())?), server)
            .map_err(|e| io_error("TLS", e.to_string()))?;
        let mut last = io_error("connect", format!("{host}:{port} resolves to no address"));
        let mut tcp = None;
        for addr in (host, port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last = e.into(),
            }
        }
        let tcp = tcp.ok_or(last)?;
        tcp.set_nodelay(true)?;
        tcp.set_read_timeout(Some(timeout))?;
        tcp.set_write_timeout(Some(timeout))?;
        let mut named = Named {
            stream: rustls::StreamOwned::new(conn, tcp),
            parser: redis::Parser::new(),
            db: ci.redis_settings().db(),
            open: true,
        };
        // the handshake, here rather than hidden in the first command
        while named.stream.conn.is_handshaking() {
            named.stream.conn.complete_io(&mut named.stream.sock).map_err(RedisError::from)?;
        }
        let s = ci.redis_settings();
        if let Some(pass) = s.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = s.username() {
                auth.arg(user);
            }
            auth.arg(pass).exec(&mut named)?;
        }
        if s.db() != 0 {
            redis::cmd("SELECT").arg(s.db()).exec(&mut named)?;
        }
        Ok(named)
    }

    fn send(&mut self, bytes: &[u8]) -> RedisResult<()> {
        let r = self.stream.write_all(bytes).and_then(|()| self.stream.flush());
        if r.is_err() {
            self.open = false;
        }
        Ok(r?)
    }

    fn recv(&mut self) -> RedisResult<Value> {
        let r = self.parser.parse_value(&mut self.stream);
        if r.as_ref().is_err_and(|e| e.is_io_error()) {
            self.open = false;
        }
        r
    }
}

impl ConnectionLike for Named {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        self.send(cmd)?;
        self.recv()
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.send(cmd)?;
        let mut out = Vec::with_capacity(count);
        for i in 0..offset + count {
            let v = self.recv()?;
            if i >= offset {
                out.push(v);
            }
        }
        Ok(out)
    }

    fn get_db(&self) -> i64 {
        self.db
    }

    fn check_connection(&mut self) -> bool {
        redis::cmd("PING").exec(self).is_ok()
    }

    fn is_open(&self) -> bool {
        self.open
    }
}

impl Wire {
    /// A connection to `ci`: the crate's, or a `Named` one when the zone
    /// has `ssl_name=` and `ci` is a TLS address. Every read and write is
    /// bounded by `timeout`.
    pub fn open(ci: redis::ConnectionInfo, tls: &Tls, timeout: Duration) -> RedisResult<Wire> {
        if let (Some(name), ConnectionAddr::TcpTls { .. }) = (&tls.name, ci.addr()) {
            return Ok(Wire::Named(Box::new(Named::connect(&ci, tls, name, timeout)?)));
        }
        let con = redis::Client::open(ci)?.get_connection_with_timeout(timeout)?;
        con.set_read_timeout(Some(timeout))?;
        con.set_write_timeout(Some(timeout))?;
        Ok(Wire::Crate(con))
    }

    pub fn send_packed_command(&mut self, cmd: &[u8]) -> RedisResult<()> {
        match self {
            Wire::Crate(c) => c.send_packed_command(cmd),
            Wire::Named(n) => n.send(cmd),
        }
    }

    pub fn recv_response(&mut self) -> RedisResult<Value> {
        match self {
            Wire::Crate(c) => c.recv_response(),
            Wire::Named(n) => n.recv(),
        }
    }
}

impl ConnectionLike for Wire {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            Wire::Crate(c) => c.req_packed_command(cmd),
            Wire::Named(n) => n.req_packed_command(cmd),
        }
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Wire::Crate(c) => c.req_packed_commands(cmd, offset, count),
            Wire::Named(n) => n.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Wire::Crate(c) => c.get_db(),
            Wire::Named(n) => n.get_db(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            Wire::Crate(c) => c.check_connection(),
            Wire::Named(n) => n.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            Wire::Crate(c) => c.is_open(),
            Wire::Named(n) => n.is_open(),
        }
    }
}
