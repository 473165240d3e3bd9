//! Strict links, the worker's part: the strict requests' script calls go
//! down a connection of the worker's own, on its event loop, so that a
//! strict request waits for one Redis round trip and nothing else (through
//! the Redis thread it also waited for the thread to wake and for the
//! answer to come back through the notification pipe). The thread makes
//! the connection and hands it over ready (`backend/link.rs`); this file
//! only writes `EVALSHA` calls and reads their answers, without blocking.
//!
//! - Requests of one key that wait together share one call; while a key's
//!   call is out, its new requests wait for the answer and go together in
//!   the next call. What waits is written at the end of the event loop's
//!   turn (a posted event), as soon as `strict::EARLY_GROUPS` keys can go
//!   while few calls are out (a long turn does not hold back the calls of
//!   the requests it read first), and right after an answer is applied,
//!   before the requests it woke are answered (what waited behind it does
//!   not wait for their responses too); the keys written together share
//!   calls (up to `strict::MAX_GROUPS` a call): one `send()`, one answer
//!   for all, cut per key.
//! - Each answer is applied as the thread's would be (`strict_answered`).
//! - An error reply (the script unknown to the server, a counter that is
//!   not an integer, a server that is not a master) means the call did not
//!   count anything: its keys go to the thread, which deals with them as
//!   it does with its own calls, a key a call (loads the script, logs,
//!   takes a backend down). A key that failed in a call of several (its
//!   part of the answer says so; it counted nothing) goes to the thread
//!   alone. A reply saying the server does not serve the key also drops
//!   the link.
//! - A failed link (closed, unreadable, no answer within `timeout=`) is
//!   dropped: calls out get no answer (they may have run: `on_error`
//!   decides), calls not written go to the thread, which checks the
//!   backend and makes a new link after a backoff.
//! - While asks handed to the thread wait for their answers, new asks of
//!   the zone follow them (`handover.rs`); Lua's `reset` writes its `DEL`
//!   down the link, between the calls made before and after it (`reset`).

mod answer;
mod fail;
mod handover;
mod reset;

pub use handover::thread_answered;
pub use reset::reset;

use std::cell::RefCell;
use std::ffi::c_void;
use std::os::fd::{IntoRawFd, OwnedFd};
use std::ptr;

use nginx_sys::{
    ngx_add_timer, ngx_close_connection, ngx_connection_t, ngx_event_t, ngx_get_connection,
    ngx_handle_read_event, ngx_handle_write_event, ngx_int_t, ngx_log_t, ngx_post_event,
    ngx_posted_events, NGX_OK,
};
use ratelimit_core::batch::ItemId;
use ratelimit_core::calls::{Calls, Handed};
use ratelimit_core::key::redis_tag_inline;
use ratelimit_core::resp;
use ratelimit_core::strict;

use crate::backend::{Channel, StrictAsk, StrictGroup};
use crate::worker::reply::main_conf;
use crate::worker::time::{mono_ms, mono_us, now_ms};

/// Bytes read per `recv()`.
const READ_CHUNK: usize = 16 << 10;
/// Most bytes of replies kept unparsed (a reply larger than `resp`'s
/// bounds is a protocol error long before this).
const MAX_INPUT: usize = 4 << 20;
/// Error replies saying the server does not serve the key (any more): the
/// link is dropped after them.
const LOST: [&str; 6] = ["READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "LOADING", "MOVED"];

/// A group's key: the key's entry and window, and the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key(ItemId, u32);

/// One word hashed: the entry's first word is a keyed hash of the key
/// already, and a link is one zone's (equal keys still compare whole).
impl std::hash::Hash for Key {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.entry[0] ^ self.0.window.rotate_left(32) ^ u64::from(self.1));
    }
}

/// A reply as the link reads it: the script's array of integers, read
/// straight into integers, or any other reply.
enum Reply<'a> {
    Ints(&'a [i64]),
    Other(resp::Value),
}

/// A zone's link. It lives as long as the worker (its flush event may be
/// posted); its connection comes and goes.
struct Link {
    zone: usize,
    c: *mut ngx_connection_t,
    timeout_ms: u64,
    /// Redis's clock minus ours, learnt when the link was made (`None`:
    /// unknown, calls carry no deadline).
    clock_offset_ms: Option<i64>,
    /// When the last answer came (`mono_us`; 0: none yet).
    answered_us: u64,
    /// The thread was asked for a link when a call found none.
    asked: bool,
    /// Asks handed to the thread (no link then, or calls that failed on
    /// it) whose answers have not come back, and when the last went: while
    /// there are any, new asks follow them through the thread, so that
    /// the zone's calls reach Redis in the order they were made
    /// (`thread_first`).
    handed: Handed,
    /// Posted to write what waits, once per turn of the event loop.
    flush: ngx_event_t,
    out: Vec<u8>,
    /// Text kept from the last calls written (`strict::Texts`).
    texts: strict::Texts,
    written: usize,
    input: Vec<u8>,
    /// The integers of the last answer read (room used again).
    ints: Vec<i64>,
    /// Requests not written yet, per key, and calls out.
    calls: Calls<Key, StrictGroup>,
}

thread_local! {
    /// Per zone index (this worker's thread only). Boxes never freed: a
    /// posted event may point into one.
    static LINKS: RefCell<Vec<Option<*mut Link>>> = const { RefCell::new(Vec::new()) };
}

/// The zone's link (made on first use).
#[inline]
fn link(zone: usize) -> *mut Link {
    made(zone).unwrap_or_else(|| make(zone))
}

#[cold]
fn make(zone: usize) -> *mut Link {
    LINKS.with(|l| {
        let mut l = l.borrow_mut();
        if l.len() <= zone {
            l.resize(zone + 1, None);
        }
        *l[zone].get_or_insert_with(|| {
            Box::into_raw(Box::new(Link {
                zone,
                c: ptr::null_mut(),
                timeout_ms: 1000,
                clock_offset_ms: None,
                answered_us: 0,
                asked: false,
                handed: Handed::default(),
                // SAFETY: an all-zero event is nginx's idle event (as
                // `ngx_pcalloc` gives); `take` sets its handler and data.
                flush: unsafe { std::mem::zeroed() },
                out: Vec::new(),
                texts: strict::Texts::default(),
                written: 0,
                input: Vec::new(),
                ints: Vec::new(),
                calls: Calls::default(),
            }))
        })
    })
}

/// The zone's link, if this worker made one.
fn made(zone: usize) -> Option<*mut Link> {
    LINKS.with(|l| l.borrow().get(zone).copied().flatten())
}

/// Takes a connection the thread made for `zone`'s strict calls (one that
/// cannot be taken is closed, and the thread asked for another).
pub fn attach(zone: usize, fd: OwnedFd, clock_offset_ms: Option<i64>, log: *mut ngx_log_t) {
    if !take(zone, fd, clock_offset_ms, log) {
        if let Some(ch) = crate::worker::channel::channel() {
            ch.want_link(zone);
        }
    }
}

fn take(zone: usize, fd: OwnedFd, clock_offset_ms: Option<i64>, log: *mut ngx_log_t) -> bool {
    let Some(mcf) = main_conf() else {
        return false;
    };
    let Some(timeout_ms) =
        mcf.zones.get(zone).and_then(|z| z.params.as_ref()).map(|p| p.timeout_ms)
    else {
        return false;
    };
    let l = link(zone);
    // SAFETY: links live for the worker's life; this thread only.
    let link = unsafe { &mut *l };
    if !link.c.is_null() {
        return true; // one at a time (the new one is closed with `fd`)
    }
    let raw = fd.into_raw_fd();
    // SAFETY: registers a connected, non-blocking socket with nginx's
    // event loop, on the worker's thread, as `worker.rs` does its pipe.
    unsafe {
        let c = ngx_get_connection(raw, log);
        if c.is_null() {
            libc::close(raw);
            return false;
        }
        (*c).data = l.cast::<c_void>();
        (*c).log = log;
        let (rev, wev) = ((*c).read, (*c).write);
        (*rev).handler = Some(on_read);
        (*rev).log = log;
        (*wev).handler = Some(on_write);
        (*wev).log = log;
        if ngx_handle_read_event(rev, 0) != NGX_OK as ngx_int_t {
            ngx_close_connection(c);
            return false;
        }
        link.flush.handler = Some(on_flush);
        link.flush.data = l.cast::<c_void>();
        link.flush.log = log;
        link.c = c;
    }
    link.timeout_ms = timeout_ms;
    link.clock_offset_ms = clock_offset_ms;
    true
}

/// Sends strict requests' limits: down the zone's link when it has one,
/// else through the thread.
pub fn send(ch: &Channel, asks: impl IntoIterator<Item = StrictAsk>) {
    let mut rest = Vec::new();
    for a in asks {
        // SAFETY: as in `take`.
        let link = unsafe { &mut *link(a.id.zone as usize) };
        if link.c.is_null() || link.thread_first() {
            if !link.asked {
                link.asked = true;
                ch.want_link(a.id.zone as usize);
            }
            link.handed.note(1, mono_ms());
            rest.push(a);
            continue;
        }
        let (ticket, cost, deadline_ms) = (a.ticket, a.cost, a.deadline_ms);
        let group = link.calls.waiting(Key(a.id, a.limit), || StrictGroup::of(&a), |g| g.renew(&a));
        group.push(ticket, cost, deadline_ms);
        if link.calls.write_early(strict::EARLY_GROUPS, strict::EARLY_MAX_OUT) {
            link.write_waiting();
        } else {
            link.post_flush();
        }
    }
    if !rest.is_empty() {
        ch.push_strict(rest);
    }
}

/// A strict request's limit, as its handler has it: `StrictAsk`'s parts,
/// the key's hash tag still to be made (`redis_tag_inline`), made where
/// its group is.
pub struct Ask<'a> {
    pub ticket: u64,
    pub id: ItemId,
    pub namespace: &'a [u8],
    pub key: &'a [u8],
    pub period: u32,
    pub limit: u32,
    pub cost: u32,
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
        g.requests.clear();
    }
}

/// `send` of one limit of a request, from its parts.
pub fn send_one(ch: &Channel, a: &Ask<'_>) {
    // SAFETY: as in `take`.
    let link = unsafe { &mut *link(a.id.zone as usize) };
    if link.c.is_null() || link.thread_first() {
        if !link.asked {
            // a zone without a `strict` limit, first decided by Redis
            // (a small limit): its link is made now
            link.asked = true;
            ch.want_link(a.id.zone as usize);
        }
        link.handed.note(1, mono_ms());
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

/// Closes the links (worker exit).
pub fn close_all() {
    let all: Vec<*mut Link> = LINKS.with(|l| l.borrow().iter().flatten().copied().collect());
    for l in all {
        // SAFETY: as in `take`.
        let link = unsafe { &mut *l };
        if !link.c.is_null() {
            // SAFETY: the connection is ours, on this thread.
            unsafe { ngx_close_connection(link.c) };
            link.c = ptr::null_mut();
        }
    }
}

unsafe extern "C" fn on_flush(ev: *mut ngx_event_t) {
    // SAFETY: the flush event's data is its link (`take`).
    let link = unsafe { &mut *(*ev).data.cast::<Link>() };
    link.write_waiting();
}

unsafe extern "C" fn on_write(ev: *mut ngx_event_t) {
    // SAFETY: nginx passes our connection's write event.
    let link = unsafe { &mut *(*(*ev).data.cast::<ngx_connection_t>()).data.cast::<Link>() };
    link.write_out();
}

unsafe extern "C" fn on_read(ev: *mut ngx_event_t) {
    // SAFETY: nginx passes our connection's read event.
    let (link, timedout) = unsafe {
        let c = (*ev).data.cast::<ngx_connection_t>();
        (&mut *(*c).data.cast::<Link>(), (*ev).timedout() != 0)
    };
    if timedout {
        // SAFETY: as above.
        unsafe { (*ev).set_timedout(0) };
        link.timed_out();
        return;
    }
    link.read();
}

// `send()` and `recv()` as system calls of their own (`syscall(2)`): the
// worker has a thread, so glibc's wrappers would bracket each with the
// bookkeeping of a thread cancellation point, which this thread never
// uses (about a third of what each call costs).

/// send(2) of `buf` to `fd`; MSG_NOSIGNAL: a closed peer is an error, not
/// a signal.
fn sys_send(fd: libc::c_int, buf: &[u8]) -> libc::c_long {
    let (null, flags) = (ptr::null::<libc::sockaddr>(), libc::MSG_NOSIGNAL);
    // SAFETY: sendto(2) reads `buf.len()` bytes of a live slice.
    unsafe { libc::syscall(libc::SYS_sendto, fd, buf.as_ptr(), buf.len(), flags, null, 0) }
}

/// recv(2) from `fd` into `room`; the bytes it returns are initialised.
fn sys_recv(fd: libc::c_int, room: &mut [std::mem::MaybeUninit<u8>]) -> libc::c_long {
    let (addr, len) = (ptr::null_mut::<libc::sockaddr>(), ptr::null_mut::<libc::socklen_t>());
    // SAFETY: recvfrom(2) writes at most `room.len()` bytes into it.
    unsafe { libc::syscall(libc::SYS_recvfrom, fd, room.as_mut_ptr(), room.len(), 0, addr, len) }
}

impl Link {
    fn post_flush(&mut self) {
        if self.flush.posted() == 0 {
            // SAFETY: the event lives as long as the worker; posted events
            // run in this turn of the event loop.
            unsafe { ngx_post_event(&raw mut self.flush, ptr::addr_of_mut!(ngx_posted_events)) };
        }
    }

    fn channel(&self) -> Option<&'static Channel> {
        crate::worker::channel::channel().map(|c| &**c)
    }

    /// Writes a call for every key that waits and has none out.
    fn write_waiting(&mut self) {
        if self.c.is_null() {
            let (_, waiting) = self.calls.drain();
            let asks: Vec<StrictAsk> =
                waiting.into_iter().flat_map(StrictGroup::into_asks).collect();
            if let Some(ch) = self.channel() {
                self.hand_over(ch, asks);
            }
            return;
        }
        let Some(mcf) = main_conf() else {
            return;
        };
        let Some(prefix) =
            mcf.zones.get(self.zone).and_then(|z| z.params.as_ref()).map(|p| &p.prefix)
        else {
            return;
        };
        let now = now_ms();
        let weight = |g: &StrictGroup| 2 + g.requests.len();
        let calls = self.calls.write(mono_us(), strict::MAX_GROUPS, strict::MAX_ANSWER, weight);
        for call in calls {
            let call = strict::Call {
                prefix,
                now_ms: now,
                clock_offset_ms: self.clock_offset_ms,
                groups: call.map(StrictGroup::keyed_group),
            };
            call.write(&mut self.out, &mut self.texts);
        }
        self.arm();
        self.write_out();
    }

    /// Writes what is buffered; the rest when the socket can take it.
    fn write_out(&mut self) {
        while self.written < self.out.len() && !self.c.is_null() {
            let rest = &self.out[self.written..];
            // SAFETY: our connection, on this thread.
            let n = sys_send(unsafe { (*self.c).fd }, rest);
            if n > 0 {
                self.written += n as usize;
                continue;
            }
            let e = std::io::Error::last_os_error();
            if n < 0 && e.kind() == std::io::ErrorKind::WouldBlock {
                // SAFETY: our connection's write event, on this thread.
                let ok = unsafe {
                    (*(*self.c).write).set_ready(0);
                    ngx_handle_write_event((*self.c).write, 0) == NGX_OK as ngx_int_t
                };
                if !ok {
                    self.fail("cannot wait to write", false);
                }
                return;
            }
            if n < 0 && e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            self.fail(&format!("send failed: {e}"), false);
            return;
        }
        self.out.clear();
        self.written = 0;
    }

    /// Reads what came and applies every whole answer.
    fn read(&mut self) {
        loop {
            if self.c.is_null() {
                return;
            }
            self.input.reserve(READ_CHUNK);
            let room = self.input.spare_capacity_mut();
            // SAFETY: our connection, on this thread.
            let n = sys_recv(unsafe { (*self.c).fd }, room);
            if n > 0 {
                let short = (n as usize) < room.len();
                // SAFETY: recv() initialised `n` bytes after the length.
                unsafe { self.input.set_len(self.input.len() + n as usize) };
                if self.input.len() > MAX_INPUT {
                    self.fail("replies too large", false);
                    return;
                }
                // a short read drained the socket (as nginx's own recv
                // reads it with epoll): more data is a new event
                if short {
                    break;
                }
                continue;
            }
            if n == 0 {
                if !self.calls.in_flight() && self.input.is_empty() {
                    // Redis's own `timeout` closing a link that had
                    // nothing out: not a failure, a new link is made
                    self.closed_idle();
                } else {
                    self.fail("connection closed by Redis", false);
                }
                return;
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::WouldBlock => break,
                std::io::ErrorKind::Interrupted => continue,
                _ => {
                    self.fail(&format!("recv failed: {e}"), false);
                    return;
                }
            }
        }
        // SAFETY: our connection's read event: drained, wait for the next.
        let ok = unsafe {
            let rev = (*self.c).read;
            (*rev).set_ready(0);
            ngx_handle_read_event(rev, 0) == NGX_OK as ngx_int_t
        };
        let mut at = 0;
        let mut lost: Option<String> = None;
        let mut ints = std::mem::take(&mut self.ints);
        while at < self.input.len() {
            let rest = &self.input[at..];
            let reply = match resp::read_ints(rest, &mut ints) {
                Ok(resp::Ints::Read(n)) => Ok(Some((Reply::Ints(&ints), n))),
                Ok(resp::Ints::Partial) => Ok(None),
                Ok(resp::Ints::Other) => {
                    resp::parse(rest).map(|r| r.map(|(v, n)| (Reply::Other(v), n)))
                }
                Err(e) => Err(e),
            };
            match reply {
                Ok(Some((v, n))) => {
                    at += n;
                    if !self.calls.in_flight() {
                        self.fail("a reply nobody asked for", false);
                        return;
                    }
                    if let Some(why) = self.answer(v) {
                        lost.get_or_insert(why);
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    self.fail("not a Redis reply", false);
                    return;
                }
            }
        }
        self.ints = ints;
        if at == self.input.len() {
            self.input.clear(); // as a rule: whole replies
        } else {
            self.input.drain(..at);
        }
        if !ok {
            self.fail("cannot wait to read", false);
            return;
        }
        if let Some(why) = lost {
            self.fail(&format!("the server does not serve the key ({why})"), false);
            return;
        }
        self.arm();
        if self.calls.has_waiting() {
            self.write_waiting();
        }
    }

    /// The read timer runs while calls are out: `timeout=` without an
    /// answer drops the link. It is set when a call goes out and none is
    /// set, and left set when the calls are answered: when it fires, the
    /// link's stall is how long ago the later of its last answer and its
    /// oldest call out was (`timed_out`). Steady traffic thus costs no
    /// timer operation per call, and more calls written do not put the
    /// timer off (a server that hangs under steady strict traffic is found
    /// within `timeout=`).
    fn arm(&mut self) {
        if self.c.is_null() || !self.calls.in_flight() {
            return;
        }
        // SAFETY: our connection's read event, on this thread.
        unsafe {
            let rev = (*self.c).read;
            if (*rev).timer_set() == 0 {
                ngx_add_timer(rev, self.timeout_ms.max(1) as _);
            }
        }
    }

    /// The read timer fired: the link is dropped if it stalled for
    /// `timeout=`, else the timer is set for the rest of it.
    fn timed_out(&mut self) {
        let Some(oldest) = self.calls.oldest_at().filter(|_| !self.c.is_null()) else {
            return; // nothing out: set again by the next call
        };
        let stalled_ms = mono_us().saturating_sub(oldest.max(self.answered_us)) / 1000;
        if stalled_ms >= self.timeout_ms {
            self.fail("no answer within timeout=", true);
            return;
        }
        // SAFETY: our connection's read event, on this thread.
        unsafe { ngx_add_timer((*self.c).read, (self.timeout_ms - stalled_ms).max(1) as _) };
    }

    /// The log its connection was attached with.
    fn log(&self) -> *mut ngx_log_t {
        self.flush.log
    }
}
