//! How a zone counts right now: through Redis, locally, or (its backend
//! down) as its `on_error` says.

use std::sync::Arc;

use ratelimit_core::counter;
use ratelimit_core::params::OnError;

use crate::backend::Channel;
use crate::nginx::conf::ZoneConf;

/// How a zone counts right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// In this node's shared memory only (no backend, or no thread).
    Local,
    /// Through the zone's Redis backend (also while it is down with
    /// `on_error=local`: the increments then stay counted locally).
    Remote,
    /// Backend down, `on_error=allow`: pass without counting.
    Allow,
    /// Backend down, `on_error=deny`: reject.
    Deny,
}

/// How long a request rejected by `on_error=deny` is told to wait.
pub(super) const DENY_RETRY_MS: u64 = 1000;

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::Remote => "redis",
            Mode::Allow => "allow (redis down)",
            Mode::Deny => "deny (redis down)",
        }
    }

    #[inline(always)]
    pub(super) fn of(zone: &ZoneConf, index: usize, channel: Option<&Arc<Channel>>) -> Mode {
        let Some(on_error) =
            zone.params.as_ref().and_then(|p| p.backend.as_ref().map(|_| p.on_error))
        else {
            return Mode::Local;
        };
        let Some(ch) = channel else {
            return Mode::Local;
        };
        if ch.is_up(index) {
            return Mode::Remote;
        }
        match on_error {
            OnError::Local => Mode::Remote,
            OnError::Allow => Mode::Allow,
            OnError::Deny => Mode::Deny,
        }
    }

    /// The mode of a strict limit that got no answer: the zone's
    /// `on_error`, as if its backend were down.
    pub(super) fn failed(zone: &ZoneConf, channel: Option<&Arc<Channel>>) -> Mode {
        match zone.params.as_ref().map(|p| p.on_error) {
            Some(OnError::Allow) => Mode::Allow,
            Some(OnError::Deny) => Mode::Deny,
            _ if channel.is_some() => Mode::Remote,
            _ => Mode::Local,
        }
    }

    /// What the zone's backend state makes of a decision from the counts.
    pub(super) fn apply(self, result: &mut counter::Check, now: u64) {
        match self {
            Mode::Allow => result.allowed = true,
            Mode::Deny => {
                result.allowed = false;
                result.retry_at_ms = now + DENY_RETRY_MS;
            }
            Mode::Local | Mode::Remote => {}
        }
    }
}
