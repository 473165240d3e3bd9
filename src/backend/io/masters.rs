//! A Redis Cluster connection's masters: one connection to each, made
//! when first needed, for the pipelines of that master's keys.
use redis::{Cmd, ConnectionAddr, RedisError, Value};

use super::{at, cluster_state_ok, is_reply, Cluster, Wire};

impl Cluster {
    /// The connection to master `node` (`host:port`), made if needed.
    pub(super) fn master(&mut self, node: &str) -> redis::RedisResult<&mut Wire> {
        if !self.masters.contains_key(node) {
            let bad =
                || RedisError::from((redis::ErrorKind::InvalidClientConfig, "bad node address"));
            let (host, port) = node.rsplit_once(':').ok_or_else(bad)?;
            let port: u16 = port.parse().map_err(|_| bad())?;
            let con = Wire::open(at(&self.base, host.to_string(), port), &self.tls, self.timeout)?;
            self.masters.insert(node.to_string(), con);
        }
        self.masters.get_mut(node).ok_or_else(|| {
            RedisError::from((redis::ErrorKind::Client, "no connection to that master"))
        })
    }

    /// Forgets the connection to a master that failed.
    pub fn drop_master(&mut self, node: &str) {
        self.masters.remove(node);
    }

    /// `f` on master `node`'s own connection; a connection that failed (not
    /// an error reply) is dropped.
    fn on_master<T>(
        &mut self,
        node: &str,
        f: impl FnOnce(&mut Wire) -> redis::RedisResult<T>,
    ) -> redis::RedisResult<T> {
        let r = self.master(node).and_then(f);
        if r.as_ref().is_err_and(|e| !is_reply(e)) {
            self.drop_master(node);
        }
        r
    }

    /// PING on master `node`'s own connection.
    pub fn ping(&mut self, node: &str) -> redis::RedisResult<()> {
        self.on_master(node, |con| redis::cmd("PING").query::<Value>(con).map(drop))
    }

    /// A command on master `node`'s own connection.
    pub fn query_on(&mut self, node: &str, cmd: &Cmd) -> redis::RedisResult<Value> {
        self.on_master(node, |con| cmd.query::<Value>(con))
    }

    /// The host of the first URL (the cluster connection's seed): a node
    /// that names itself with an empty endpoint was reached there.
    pub fn seed_host(&self) -> String {
        match self.base.addr() {
            ConnectionAddr::Tcp(host, _) | ConnectionAddr::TcpTls { host, .. } => host.clone(),
            _ => String::new(),
        }
    }

    /// PING and `CLUSTER INFO` through the cluster connection (any node).
    pub fn check(&mut self) -> redis::RedisResult<()> {
        redis::cmd("PING").query::<Value>(&mut self.router)?;
        cluster_state_ok(&mut self.router)
    }

    /// `CLUSTER INFO` on master `node`'s own connection: an error unless
    /// the cluster is `ok`.
    pub fn state_on(&mut self, node: &str) -> redis::RedisResult<()> {
        self.on_master(node, |con| cluster_state_ok(con))
    }
}
