//! A request a bucket delays (`burst=` without `nodelay`) waits on its
//! connection's write event timer, as `limit_req` delays one: the worker
//! goes on, a client that goes away ends the wait (`ngx_http_test_reading`;
//! what it added to the bucket stays), and when the timer fires the phases
//! run again from this one, whose handler then lets the request through
//! (`delayed`).

use std::ffi::c_void;
use std::ptr;

use nginx_sys::{
    ngx_add_timer, ngx_del_timer, ngx_handle_read_event, ngx_handle_write_event,
    ngx_http_block_reading, ngx_http_core_run_phases, ngx_http_finalize_request,
    ngx_http_request_t, ngx_http_test_reading, ngx_int_t, ngx_post_event, ngx_posted_events,
    NGX_AGAIN, NGX_DECLINED, NGX_DONE, NGX_HTTP_INTERNAL_SERVER_ERROR, NGX_OK,
};
use ngx::http::HttpModule;

use crate::conf::module::Module;
use crate::http::Failure;

/// What the module's context slot of a delayed request points to: the
/// request was decided and waited, its handler lets it through.
static DELAYED: u8 = 0;

/// Whether the request waited for a bucket's delay (its phases run again).
#[inline]
pub fn delayed(r: &ngx_http_request_t) -> bool {
    let i = Module::module().ctx_index;
    // SAFETY: every request has a context array with a slot per module.
    let slot = unsafe { *r.ctx.add(i) };
    ptr::eq(slot.cast::<u8>(), &DELAYED)
}

/// Makes the request wait `ms` before its next phase. A subrequest is not
/// delayed (it shares its main request's connection and events).
pub fn delay(r: &mut ngx_http_request_t, ms: u64) -> Result<ngx_int_t, Failure> {
    if !ptr::eq(r.main, r) {
        return Ok(NGX_DECLINED as ngx_int_t);
    }
    let i = Module::module().ctx_index;
    // SAFETY: the context slot holds a pointer to a static that is never
    // written.
    unsafe { *r.ctx.add(i) = ptr::from_ref(&DELAYED).cast_mut().cast::<c_void>() };
    park(r, wake, ms)?;
    Ok(NGX_AGAIN as ngx_int_t)
}

/// Parks a main request on its connection's write event for `ms`, as
/// `limit_req` delays one: a client that goes away ends the wait
/// (`ngx_http_test_reading`), and `then` runs when the timer fires (or a
/// write event comes first: it re-arms while `delayed` is set). Also a
/// strict request's wait for Redis.
pub fn park(
    r: &mut ngx_http_request_t,
    then: unsafe extern "C" fn(*mut ngx_http_request_t),
    ms: u64,
) -> Result<(), Failure> {
    // SAFETY: the request's connection and its events are valid while the
    // request lives.
    unsafe {
        let c = r.connection;
        let rev = (*c).read;
        if (*rev).ready() != 0 {
            ngx_post_event(rev, ptr::addr_of_mut!(ngx_posted_events));
        } else if ngx_handle_read_event(rev, 0) != NGX_OK as ngx_int_t {
            return Err(Failure::Event);
        }
        r.read_event_handler = Some(ngx_http_test_reading);
        r.write_event_handler = Some(then);
        let wev = (*c).write;
        (*wev).set_delayed(1);
        ngx_add_timer(wev, ms.max(1) as _);
    }
    Ok(())
}

/// The write event handler of a delayed request: the timer ran out (nginx
/// clears `delayed` then), so the phases run again; a write event before
/// it only re-arms the event.
unsafe extern "C" fn wake(r: *mut ngx_http_request_t) {
    // SAFETY: nginx passes the request whose event fired.
    unsafe {
        if unpark(r) {
            ngx_http_core_run_phases(r);
        }
    }
}

/// A parked request's write event fired (`park`): false while it still
/// waits (a write event before its time: the event is re-armed) or when it
/// failed (it is finalized); else its timer is gone and the phases' handlers
/// are its own again.
///
/// # Safety
///
/// `r` is the live request whose parked write event fired.
pub unsafe fn unpark(r: *mut ngx_http_request_t) -> bool {
    // SAFETY: as in `limit_req`'s delay handler; the caller's request.
    unsafe {
        let c = (*r).connection;
        let wev = (*c).write;
        if (*wev).delayed() != 0 {
            if ngx_handle_write_event(wev, 0) != NGX_OK as ngx_int_t {
                ngx_http_finalize_request(r, NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t);
            }
            return false;
        }
        if (*wev).timer_set() != 0 {
            ngx_del_timer(wev);
        }
        if ngx_handle_read_event((*c).read, 0) != NGX_OK as ngx_int_t {
            ngx_http_finalize_request(r, NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t);
            return false;
        }
        (*r).read_event_handler = Some(ngx_http_block_reading);
        (*r).write_event_handler = Some(ngx_http_core_run_phases);
    }
    true
}

/// What nginx's phase engine does with a preaccess handler's answer, for a
/// request answered outside it (woken): on to the next handler, a wait (a
/// bucket's delay, a lease), or the end.
pub fn go_on(r: &mut ngx_http_request_t, rc: ngx_int_t) {
    if rc == NGX_AGAIN as ngx_int_t || rc == NGX_DONE as ngx_int_t {
        return;
    }
    // SAFETY: the live request, on its connection's thread.
    unsafe {
        if rc == NGX_DECLINED as ngx_int_t {
            r.phase_handler += 1;
            ngx_http_core_run_phases(r);
        } else {
            ngx_http_finalize_request(r, rc);
        }
    }
}
