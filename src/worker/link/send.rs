//! Strict requests' limits into their zone's link: each joins its key's
//! group (a group per key and limit, made new in a place used before),
//! written at once or at the end of the event loop's turn; through the
//! thread while the zone has no link, or while asks handed to it earlier
//! wait for their answers (`handover.rs`).

use ratelimit_core::batch::ItemId;
use ratelimit_core::key::redis_tag_inline;
use ratelimit_core::strict::{self, Kind};
use ratelimit_core::tickets::{Ticket, NO_TICKET};

use super::link;
use crate::backend::{Channel, StrictAsk, StrictGroup};
use crate::worker::time::mono_ms;

/// A group's key: the key's entry and window, and the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Key(ItemId, u32);

/// One word hashed: the entry's first word is a keyed hash of the key
/// already, and a link is one zone's (equal keys still compare whole).
impl std::hash::Hash for Key {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.entry.0[0] ^ self.0.window.rotate_left(32) ^ u64::from(self.1));
    }
}

/// A strict request's limit, as its handler has it: `StrictAsk`'s parts,
/// the key's hash tag still to be made (`redis_tag_inline`), made where
/// its group is.
pub struct Ask<'a> {
    /// Names the waiting request and which of its limits this is
    /// (`waits::NO_TICKET`: a count no request waits for).
    pub ticket: Ticket,
    pub id: ItemId,
    pub namespace: &'a [u8],
    pub key: &'a [u8],
    pub period: u32,
    pub limit: u32,
    pub kind: Kind,
    pub cost: u32,
    /// As `StrictAsk`'s.
    pub deadline_ms: u64,
}

impl Ask<'_> {
    fn to_strict(&self) -> StrictAsk {
        StrictAsk {
            ticket: self.ticket,
            id: self.id,
            tag: redis_tag_inline(self.namespace, self.key),
            period: self.period,
            limit: self.limit,
            kind: self.kind,
            cost: self.cost,
            deadline_ms: self.deadline_ms,
        }
    }

    /// A group of this key and limit with none of its requests, made new
    /// in place. A place last used by the same key keeps its tag: the
    /// entry names the namespace, the key and the period (as the zone's
    /// table does).
    fn renew(&self, g: &mut StrictGroup) {
        if g.id.zone != self.id.zone || g.id.entry != self.id.entry || g.tag.is_empty() {
            g.tag = redis_tag_inline(self.namespace, self.key);
        }
        g.id = self.id;
        g.period = self.period;
        g.limit = self.limit;
        g.kind = self.kind;
        g.requests.clear();
    }
}

/// Sends one limit of a strict request (or a count after the response):
/// down the zone's link when it has one, else through the thread.
pub fn send_one(ch: &Channel, a: &Ask<'_>) {
    // SAFETY: links live for the worker's life; this thread only.
    let link = unsafe { &mut *link(a.id.zone as usize) };
    if through_thread(link, ch, a.id.zone) {
        ch.push_strict([a.to_strict()]);
        return;
    }
    let group =
        link.calls.waiting(Key(a.id, a.limit), || StrictGroup::from(a.to_strict()), |g| a.renew(g));
    group.push(a.ticket, a.cost, a.deadline_ms);
    if link.calls.write_early(strict::EARLY_GROUPS, strict::EARLY_MAX_OUT) {
        link.write_waiting();
    } else {
        link.post_flush();
    }
}

/// Whether what is sent now goes through the thread (the zone has no
/// link, or asks handed to the thread wait for their answers); the link
/// is asked for when it has none.
fn through_thread(link: &mut super::Link, ch: &Channel, zone: u32) -> bool {
    if !link.c.is_null() && !link.thread_first() {
        return false;
    }
    if !link.asked {
        // a zone without a `strict` limit, first decided by Redis (a
        // small limit, a bucket, a concurrency limit): its link is made now
        link.asked = true;
        ch.want_link(zone as usize);
    }
    link.handed.note(1, mono_ms());
    true
}

/// A holder's ask for its lease of a key's slots (`holdings`): what it
/// uses and what it asks to hold, as of now.
pub struct Conn<'a> {
    pub id: ItemId,
    pub namespace: &'a [u8],
    pub key: &'a [u8],
    pub max: u32,
    pub lease_ms: u32,
    pub uses: u32,
    pub wants: u32,
}

/// Sends a holder's ask for its lease: a conn group of two counted
/// requests (`strict::Kind::Conn`), what it uses and what it asks to
/// hold, brought up to date when the call is written
/// (`holdings::refresh`). A key whose group waits already is asked once.
pub fn send_conn(ch: &Channel, c: &Conn<'_>) {
    let a = Ask {
        ticket: NO_TICKET,
        id: c.id,
        namespace: c.namespace,
        key: c.key,
        period: c.lease_ms,
        limit: c.max,
        kind: Kind::Conn,
        cost: c.uses,
        deadline_ms: strict::COUNTED,
    };
    // SAFETY: links live for the worker's life; this thread only.
    let link = unsafe { &mut *link(c.id.zone as usize) };
    if through_thread(link, ch, c.id.zone) {
        ch.push_strict([a.to_strict(), Ask { cost: c.wants, ..a }.to_strict()]);
        return;
    }
    let group =
        link.calls.waiting(Key(a.id, a.limit), || StrictGroup::from(a.to_strict()), |g| a.renew(g));
    if group.requests.is_empty() {
        group.push(NO_TICKET, c.uses, strict::COUNTED);
        group.push(NO_TICKET, c.wants, strict::COUNTED);
    }
    link.conn_waiting = true;
    link.post_flush();
}
