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
mod read;
mod reset;
mod send;

pub use handover::thread_answered;
pub use reset::reset;
pub use send::{send_conn, send_one, Ask, Conn};

use read::Reply;
use send::Key;

use std::cell::RefCell;
use std::ffi::c_void;
use std::os::fd::{IntoRawFd, OwnedFd};
use std::ptr;

use nginx_sys::{
    ngx_add_timer, ngx_close_connection, ngx_connection_t, ngx_event_t, ngx_get_connection,
    ngx_handle_read_event, ngx_handle_write_event, ngx_int_t, ngx_log_t, ngx_post_event,
    ngx_posted_events, NGX_OK,
};
use ratelimit_core::calls::{Calls, Handed};
use ratelimit_core::strict;

use crate::backend::{Channel, StrictAsk, StrictGroup};
use crate::worker::reply::main_conf;
use crate::worker::time::{mono_us, now_ms};

/// Bytes read per `recv()`.
const READ_CHUNK: usize = 16 << 10;
/// Most bytes of replies kept unparsed (a reply larger than `resp`'s
/// bounds is a protocol error long before this).
const MAX_INPUT: usize = 4 << 20;
/// Error replies saying the server does not serve the key (any more): the
/// link is dropped after them.
const LOST: [&str; 6] = ["READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "LOADING", "MOVED"];

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
    /// A holder's ask (a conn group) may wait to be written.
    conn_waiting: bool,
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
                conn_waiting: false,
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
        // its timer (`arm`) must not hold a graceful exit: the requests
        // that wait for the link have timers of their own
        (*rev).set_cancelable(1);
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
        // a holder's ask for its lease says what it uses as it goes
        if self.conn_waiting {
            self.calls.each_ready(|g| {
                if g.kind == strict::Kind::Conn {
                    crate::worker::holdings::state::refresh(g);
                }
            });
        }
        let now = now_ms();
        let weight = |g: &StrictGroup| 2 + g.requests.len();
        let calls = self.calls.write(mono_us(), strict::MAX_GROUPS, strict::MAX_ANSWER, weight);
        for call in calls {
            let call = strict::Call {
                prefix,
                now_ms: now,
                clock_offset_ms: self.clock_offset_ms,
                holder: crate::backend::holder(),
                groups: call.map(StrictGroup::keyed_group),
            };
            call.write(&mut self.out, &mut self.texts);
        }
        // a conn group behind a call out is written (and brought up to
        // date) later
        self.conn_waiting = self.conn_waiting && self.calls.has_waiting();
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
