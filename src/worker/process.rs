//! The worker side of the Redis backend: starts the background thread in
//! `init_process` and stops it in `exit_process`, queues increments from the
//! request path, and applies the thread's answers to the zones on the
//! worker's own thread when the notification pipe wakes the event loop.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use nginx_sys::{
    ngx_close_connection, ngx_connection_t, ngx_cycle_t, ngx_event_t, ngx_get_connection,
    ngx_handle_read_event, ngx_int_t, ngx_log_t, NGX_LOG_ALERT, NGX_LOG_WARN, NGX_OK,
};
use ngx::http::HttpModuleMainConf;
use ngx::{ngx_log_debug, ngx_log_error};
use parking_lot::Mutex;
use ratelimit_core::counter;
use ratelimit_core::params::OnError;
use ratelimit_core::rate::Rate;

use crate::backend::{self, Channel, Event, StatsRef, ZoneSpec};
use crate::conf::module::Module;
use crate::worker::reply::{self, confirmed, main_conf, with_entry, zone_log};
use crate::worker::time::now_ms;

static HANDLE: Mutex<Option<Handle>> = Mutex::new(None);

struct Handle {
    thread: JoinHandle<()>,
    conn: *mut ngx_connection_t,
    write_fd: i32,
    stop_wait: Duration,
}

// SAFETY: the connection pointer is only used on the worker's main thread
// (init_process / exit_process); the mutex just gives the static a home.
unsafe impl Send for Handle {}

fn pipe() -> Option<[i32; 2]> {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe() returns.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return None;
    }
    for fd in fds {
        // SAFETY: fcntl on descriptors we just created.
        unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
    Some(fds)
}

fn close(fd: i32) {
    // SAFETY: closes a descriptor this module created and owns.
    unsafe { libc::close(fd) };
}

/// `init_process`: one background thread per worker for all Redis zones.
pub unsafe extern "C" fn init_process(cycle: *mut ngx_cycle_t) -> ngx_int_t {
    // SAFETY: nginx passes the worker's cycle.
    unsafe { start(cycle) };
    NGX_OK as ngx_int_t
}

/// Whether `start` ran in this worker (on its main thread only).
static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Starts the worker's Redis thread, once: from `init_process`, or
/// earlier, from the Lua ABI, when another module's `init_process` (Lua's
/// `init_worker_by_lua*`, for modules loaded before this one) counts before
/// this module's runs, so that those counts reach Redis too.
///
/// # Safety
/// `cycle` is the worker's cycle; called on the worker's main thread.
pub unsafe fn start(cycle: *mut ngx_cycle_t) {
    use std::sync::atomic::Ordering;
    if STARTED.load(Ordering::Acquire) || STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: per the function's contract.
    unsafe { start_thread(cycle) };
}

/// # Safety
/// As `start`.
unsafe fn start_thread(cycle: *mut ngx_cycle_t) {
    // SAFETY: the caller passes the worker's cycle.
    let cycle_ref = unsafe { &*cycle };
    let log = cycle_ref.log;
    let Some(mcf) = Module::main_conf_mut(cycle_ref) else {
        return; // no http block
    };
    let specs: Vec<ZoneSpec> = mcf
        .zones
        .iter()
        .enumerate()
        .filter_map(|(i, z)| {
            let p = z.params.as_ref()?;
            let b = p.backend.as_ref()?;
            Some(ZoneSpec {
                index: i as u32,
                name: z.name.clone(),
                urls: b.urls.clone(),
                cluster: b.cluster,
                sentinel: b.sentinel.clone(),
                prefix: p.prefix.clone(),
                timeout: Duration::from_millis(p.timeout_ms),
                tls: backend::Tls {
                    certs: b.tls.as_ref().map(|t| redis::TlsCertificates {
                        client_tls: t.certificate.clone().zip(t.key.clone()).map(
                            |(client_cert, client_key)| redis::ClientTlsConfig {
                                client_cert,
                                client_key,
                            },
                        ),
                        root_cert: t.trusted.clone(),
                    }),
                    name: b.tls.as_ref().and_then(|t| t.name.clone()),
                },
                strict: z.strict_at.is_some(),
                share: p.on_error == OnError::Share,
                bytes: p.size,
                stats: z.shared.as_ref().map(|s| StatsRef::new(s.stats())),
                ring: z.shared.as_ref().and_then(crate::shm::Shared::ring),
            })
        })
        .collect();
    if specs.is_empty() {
        return;
    }
    // the final flush (bounded by STOP_FLUSH) plus one exchange that may
    // have started just before it, bounded by its timeout
    let stop_wait = specs.iter().map(|s| s.timeout * 3).max().unwrap_or_default()
        + backend::STOP_FLUSH
        + Duration::from_millis(200);

    let Some([rfd, wfd]) = pipe() else {
        ngx_log_error!(
            NGX_LOG_ALERT,
            log,
            "redis_ratelimit: pipe() failed, Redis zones count on this node only"
        );
        return;
    };
    // SAFETY: registers the read end with nginx's event loop, on the
    // worker's main thread, as nginx's own modules do.
    let conn = unsafe { ngx_get_connection(rfd, log) };
    if conn.is_null() {
        close(rfd);
        close(wfd);
        return;
    }
    // SAFETY: `conn` was just returned by nginx with valid events.
    unsafe {
        let rev = (*conn).read;
        (*rev).handler = Some(on_notify);
        (*rev).log = log;
        if ngx_handle_read_event(rev, 0) != NGX_OK as ngx_int_t {
            ngx_close_connection(conn);
            close(wfd);
            return;
        }
    }

    // a worker killed before this one started left counts in flight that
    // no thread will answer
    for (i, z) in mcf.zones.iter().enumerate() {
        let Some(shared) =
            z.shared.as_ref().filter(|_| specs.iter().any(|s| s.index as usize == i))
        else {
            continue;
        };
        for pid in shared.stats().waiting.reap(backend::process_alive) {
            reply::orphaned(mcf, log, i as u32, pid);
        }
    }

    // held counts may take as much memory as the Redis zones
    let zone_bytes = mcf
        .zones
        .iter()
        .filter_map(|z| z.params.as_ref().filter(|p| p.backend.is_some()))
        .map(|p| p.size)
        .sum();
    let bounds = ratelimit_core::batch::Bounds::for_zones(zone_bytes);
    let channel = Arc::new(Channel::new(mcf.zones.len(), wfd, bounds));
    let n = specs.len();
    match backend::spawn(channel.clone(), specs) {
        Ok(thread) => {
            reply::set_main_conf(mcf);
            crate::worker::channel::set(cycle, channel);
            *HANDLE.lock() = Some(Handle { thread, conn, write_fd: wfd, stop_wait });
            ngx_log_debug!(log, "redis_ratelimit: background thread started, {} Redis zone(s)", n);
        }
        Err(e) => {
            ngx_log_error!(
                NGX_LOG_ALERT,
                log,
                "redis_ratelimit: cannot start the background thread ({}), Redis zones count on this node only",
                e
            );
            // SAFETY: the connection is ours and not used anymore.
            unsafe { ngx_close_connection(conn) };
            close(wfd);
        }
    }
}

/// `exit_process`: stops and joins the thread (bounded wait: a thread stuck
/// on a hanging Redis is at most `3 x timeout` away from noticing).
pub unsafe extern "C" fn exit_process(cycle: *mut ngx_cycle_t) {
    let Some(h) = HANDLE.lock().take() else {
        return;
    };
    // SAFETY: nginx passes the worker's cycle.
    let log = unsafe { (*cycle).log };
    crate::worker::link::close_all();
    if let Some(mcf) = reply::main_conf() {
        crate::worker::holdings::state::leave(mcf);
    }
    if let Some(ch) = crate::worker::channel::any() {
        if ch.stop(h.stop_wait) {
            let _ = h.thread.join();
            close(h.write_fd);
            // what the last flush brought back: apply it, so that no
            // increment stays in flight in the zone after this worker
            apply(log);
            ngx_log_debug!(log, "redis_ratelimit: background thread stopped");
        } else {
            ngx_log_error!(
                NGX_LOG_WARN,
                log,
                "redis_ratelimit: background thread did not stop in {:?}, leaving it",
                h.stop_wait
            );
        }
    }
    // SAFETY: the connection was created in init_process on this thread.
    unsafe { ngx_close_connection(h.conn) };
}

unsafe extern "C" fn on_notify(ev: *mut ngx_event_t) {
    // SAFETY: nginx passes our read event; its data is our connection.
    let (c, log) = unsafe {
        let c = (*ev).data.cast::<ngx_connection_t>();
        (c, (*ev).log)
    };
    let mut buf = [0u8; 256];
    loop {
        // SAFETY: reads into a local buffer from the pipe's read end.
        let n = unsafe { libc::read((*c).fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
    }
    // SAFETY: `ev` is valid; edge-triggered events must be cleared after
    // draining, level-triggered ones are re-armed by nginx as needed.
    unsafe {
        (*ev).set_ready(0);
        ngx_handle_read_event(ev, 0);
    }
    apply(log);
}

/// Applies the thread's answers to the zones (worker thread only).
fn apply(log: *mut ngx_log_t) {
    let Some(ch) = crate::worker::channel::any() else {
        return;
    };
    if crate::worker::channel::channel().is_none() {
        // reloaded in place (no master): these answers are for zones of a
        // configuration that is gone
        drop(ch.take_events());
        return;
    }
    let Some(mcf) = main_conf() else {
        return;
    };
    let now = now_ms();
    for event in ch.take_events() {
        match event {
            Event::Confirmed { id, period, limit, confirmation } => {
                confirmed(mcf, log, id, Rate { limit, period }, &confirmation, now, |_| {});
            }
            Event::Strict { id, period, limit, kind, counted, tickets, answer } => {
                crate::worker::link::thread_answered(id.zone as usize, tickets.len());
                reply::strict_answered(
                    mcf,
                    log,
                    reply::Decided { id, rate: Rate { limit, period }, kind },
                    tickets.iter().copied(),
                    counted,
                    answer.as_ref(),
                );
            }
            Event::KeepLocal { id, sent } => with_entry(mcf, id, |e| {
                counter::keep_local(e, id.window, sent);
            }),
            Event::Orphaned { zone, pid } => reply::orphaned(mcf, log, zone, pid),
            Event::Log { zone, level, message } => zone_log(mcf, log, zone, level, &message),
            Event::ControlsRead { zone, version, held } => {
                crate::worker::controls::read(mcf, log, zone as usize, version, held, now)
            }
            Event::ControlWritten { zone, key, kind, version } => {
                crate::worker::controls::written(mcf, zone as usize, &key, kind, version)
            }
            Event::Link { zone, fd, clock_offset_ms } => {
                crate::worker::link::attach(zone as usize, fd, clock_offset_ms, log)
            }
        }
    }
}
