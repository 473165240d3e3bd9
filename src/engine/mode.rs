//! How a zone counts right now (`decide::Mode`): through Redis, locally,
//! or (its backend down) as its `on_error` says.

use ratelimit_core::decide::Mode;
use ratelimit_core::params::OnError;

use crate::conf::ZoneConf;

/// The mode of a zone whose backend is up or not (`up`: `None` without a
/// Redis thread in this process).
#[inline(always)]
pub(super) fn of(zone: &ZoneConf, up: Option<bool>) -> Mode {
    let Some(on_error) = zone.params.as_ref().and_then(|p| p.backend.as_ref().map(|_| p.on_error))
    else {
        return Mode::Local;
    };
    match up {
        None => Mode::Local,
        Some(true) => Mode::Remote,
        Some(false) => down(on_error),
    }
}

/// The mode of a limit Redis decides that got no answer: the zone's
/// `on_error`, as if its backend were down (`thread`: this process has a
/// Redis thread).
pub(super) fn failed(zone: &ZoneConf, thread: bool) -> Mode {
    match zone.params.as_ref().map(|p| p.on_error) {
        Some(OnError::Allow) => Mode::Allow,
        Some(OnError::Deny) => Mode::Deny,
        Some(OnError::Share) if thread => Mode::Share,
        _ if thread => Mode::Remote,
        _ => Mode::Local,
    }
}

/// A backend down: counted here (`local`, sent when it is back), or every
/// request let through, or refused.
#[inline]
fn down(on_error: OnError) -> Mode {
    match on_error {
        OnError::Local => Mode::Remote,
        OnError::Allow => Mode::Allow,
        OnError::Deny => Mode::Deny,
        OnError::Share => Mode::Share,
    }
}
