//! A strict link's reading: what came is read until the socket is
//! drained, each whole reply is applied to the oldest call out (`answer`),
//! and what waits behind the answered calls is written.

use std::ptr;

use nginx_sys::{ngx_handle_read_event, ngx_int_t, NGX_OK};
use ratelimit_core::resp;

use super::{Link, MAX_INPUT, READ_CHUNK};

/// A reply as the link reads it: the script's array of integers, read
/// straight into integers, or any other reply.
pub(super) enum Reply<'a> {
    Ints(&'a [i64]),
    Other(resp::Value),
}

impl Link {
    /// Reads what came and applies every whole answer.
    pub(super) fn read(&mut self) {
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
}

/// recv(2) from `fd` into `room`; the bytes it returns are initialised.
fn sys_recv(fd: libc::c_int, room: &mut [std::mem::MaybeUninit<u8>]) -> libc::c_long {
    let (addr, len) = (ptr::null_mut::<libc::sockaddr>(), ptr::null_mut::<libc::socklen_t>());
    // SAFETY: recvfrom(2) writes at most `room.len()` bytes into it.
    unsafe { libc::syscall(libc::SYS_recvfrom, fd, room.as_mut_ptr(), room.len(), 0, addr, len) }
}
