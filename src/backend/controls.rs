//! The zone's controls in Redis (`ratelimit_core::control`): the node's
//! sender reads them every `POLL_MS` (the whole hash only when its version
//! moved); any worker's thread writes the changes its worker made. What
//! was read goes to the worker (`Event::ControlsRead`), which makes the
//! zone's table what Redis holds and hands back what Redis still lacks.

use std::time::{Duration, Instant};

use ratelimit_core::control::{self, Change, Held, READ_SCRIPT, VERSION_TTL_MS, WRITE_SCRIPT};
use redis::Value;

use super::event::Event;
use super::io::Reply;
use super::server::Server;

/// How often the sender tries again to read controls Redis refused it
/// (an ACL without their commands).
const REFUSED_RETRY: Duration = Duration::from_secs(60);

/// What the thread knows of its zone's controls in Redis.
pub(super) struct ControlSync {
    /// When the sender reads them next.
    pub(super) due: Instant,
    /// The version read last (`None`: not read yet; empty: Redis had none).
    known: Option<Vec<u8>>,
    /// Redis refused the last read (said once, tried every `REFUSED_RETRY`).
    refused: bool,
}

impl ControlSync {
    pub(super) fn new(now: Instant) -> ControlSync {
        ControlSync { due: now, known: None, refused: false }
    }

    /// Forgets the version read (the sender changed hands: the new one
    /// reads everything).
    pub(super) fn forget(&mut self) {
        self.known = None;
    }

    /// Reads the zone's controls when due: `Event::ControlsRead`, with what
    /// Redis holds when its version is not the one known.
    pub(super) fn read(&mut self, server: &mut Server, events: &mut Vec<Event>) {
        let now = Instant::now();
        if now < self.due {
            return;
        }
        self.due = now + Duration::from_millis(control::POLL_MS);
        if !server.ensure_conn(events) {
            return;
        }
        let hash = control::redis_key(&server.spec.prefix, &server.spec.name, false);
        let node = server.node_of(&hash);
        if !server.node_may_send(node.as_deref(), now) {
            return;
        }
        let mut read = redis::cmd("EVAL");
        read.arg(READ_SCRIPT)
            .arg(2)
            .arg(&hash)
            .arg(control::redis_key(&server.spec.prefix, &server.spec.name, true))
            .arg(self.known.as_deref().unwrap_or(b"-"));
        let Some((replies, broken)) = server.exec(&[read], node.as_deref(), None, &|_| None) else {
            return;
        };
        let zone = server.spec.index;
        match replies.first() {
            Some(Reply::Value(Value::Array(items))) => {
                let version = items.first().and_then(bytes).unwrap_or_default();
                let held = (items.len() > 1 || self.known.as_deref() != Some(&version[..]))
                    .then(|| read_held(&items[1..]));
                let version_n = std::str::from_utf8(&version)
                    .ok()
                    .and_then(|t| t.parse::<u64>().ok())
                    .unwrap_or(0);
                self.known = Some(version);
                self.refused = false;
                events.push(Event::ControlsRead { zone, version: version_n, held });
            }
            Some(Reply::Refused { text, .. }) => {
                self.due = now + REFUSED_RETRY;
                if !self.refused {
                    self.refused = true;
                    events.push(Event::Log {
                        zone,
                        level: super::Level::Error,
                        message: format!(
                            "redis_ratelimit: zone \"{}\": Redis refuses the read of the zone's blocked and overridden keys ({}): those set on other nodes are not seen here, tried again every {} s; a Redis user with an ACL needs HGETALL, HSET, HDEL, INCR, PEXPIRE, PEXPIREAT and PTTL beside EVAL, GET and TIME",
                            server.spec.name,
                            ratelimit_core::text::one_line(text, 200),
                            REFUSED_RETRY.as_secs()
                        ),
                    });
                }
            }
            _ => {}
        }
        server.exchanged(node.as_deref(), broken, events);
    }

    /// Writes one change of the worker's; `Event::ControlWritten` when
    /// Redis took it (else the worker hands it again after a read).
    pub(super) fn write(&mut self, server: &mut Server, change: &Change, events: &mut Vec<Event>) {
        if !server.health.is_up() || !server.ensure_conn(events) {
            return;
        }
        let hash = control::redis_key(&server.spec.prefix, &server.spec.name, false);
        let node = server.node_of(&hash);
        let mut write = redis::cmd("EVAL");
        write
            .arg(WRITE_SCRIPT)
            .arg(2)
            .arg(&hash)
            .arg(control::redis_key(&server.spec.prefix, &server.spec.name, true))
            .arg(change.field())
            .arg(change.left_ms.unwrap_or(0))
            .arg(change.payload())
            .arg(VERSION_TTL_MS);
        let Some((replies, broken)) = server.exec(&[write], node.as_deref(), None, &|_| None)
        else {
            return;
        };
        match replies.first() {
            Some(Reply::Value(Value::Int(v))) => events.push(Event::ControlWritten {
                zone: server.spec.index,
                key: change.key.clone(),
                kind: change.kind,
                version: u64::try_from(*v).unwrap_or(0),
            }),
            Some(Reply::Refused { text, .. }) => events.push(Event::Log {
                zone: server.spec.index,
                level: super::Level::Error,
                message: format!(
                    "redis_ratelimit: zone \"{}\": writing a {}: {}",
                    server.spec.name,
                    change.kind.name(),
                    ratelimit_core::text::one_line(text, 200)
                ),
            }),
            _ => {}
        }
        server.exchanged(node.as_deref(), broken, events);
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.as_bytes().to_vec()),
        Value::Int(n) => Some(n.to_string().into_bytes()),
        _ => None,
    }
}

/// The read script's triples (field, time left, payload) as controls;
/// what this version cannot read is left out.
fn read_held(items: &[Value]) -> Vec<Held> {
    items
        .chunks_exact(3)
        .filter_map(|t| {
            let (Some(field), Value::Int(left), Some(payload)) =
                (bytes(&t[0]), &t[1], bytes(&t[2]))
            else {
                return None;
            };
            control::held(&field, *left, &payload)
        })
        .collect()
}
