//! What a request's variables give a limit: a value given with variables
//! (`read`: one variable by its index, or text with variables), and a
//! zone's key for the request (`key`).

use nginx_sys::{
    ngx_http_complex_value, ngx_http_complex_value_t, ngx_http_get_flushed_variable,
    ngx_http_request_t, ngx_int_t, ngx_str_t, ngx_uint_t, ngx_variable_value_t, NGX_OK,
};

use crate::conf::{MainConf, Source};
use crate::http::Failure;

/// A value with variables, for this request.
pub fn read<'r>(r: &mut ngx_http_request_t, src: Source) -> Result<&'r [u8], Failure> {
    match src {
        Source::Index(i) => Ok(variable(r, i)),
        Source::Complex(cv) => eval(r, cv),
    }
}

/// An indexed variable's value for this request (empty when not found).
fn variable<'r>(r: &mut ngx_http_request_t, index: ngx_uint_t) -> &'r [u8] {
    // SAFETY: the index was obtained at configuration time for this cycle;
    // the value lives as long as the request.
    let v = unsafe { ngx_http_get_flushed_variable(r, index) };
    // SAFETY: non-null values point at nginx's value for this request.
    let Some(v) = (unsafe { v.as_ref() }) else {
        return &[];
    };
    let (len, not_found) = len_and_not_found(v);
    if not_found || len == 0 || v.data.is_null() {
        return &[];
    }
    // SAFETY: `len` bytes at `data`, in the request's pool or static.
    unsafe { std::slice::from_raw_parts(v.data, len) }
}

/// A variable value's `len:28` and `not_found:1` bit fields. The generated
/// accessors take them apart a bit at a time, on every request; on a
/// little-endian target the C compiler packs them from
/// the lowest bit of the first 32-bit word (`len`, `valid`, `no_cacheable`,
/// `not_found`, `escape`), so one load and two masks read them.
#[inline(always)]
fn len_and_not_found(v: &ngx_variable_value_t) -> (usize, bool) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the struct begins with its bit fields' 4 bytes, aligned for
        // a u32 (`_bitfield_align_1`).
        let word = unsafe { std::ptr::from_ref(v).cast::<u32>().read() };
        ((word & 0x0fff_ffff) as usize, word & (1 << 30) != 0)
    }
    #[cfg(not(target_endian = "little"))]
    {
        (v.len() as usize, v.not_found() != 0)
    }
}

/// A complex value evaluated for this request (in its pool).
fn eval<'r>(
    r: &mut ngx_http_request_t,
    cv: *mut ngx_http_complex_value_t,
) -> Result<&'r [u8], Failure> {
    let mut value = ngx_str_t::empty();
    // SAFETY: the complex value was compiled at configuration time for this
    // cycle; the result lives in the request pool.
    if unsafe { ngx_http_complex_value(r, cv, &mut value) } != NGX_OK as ngx_int_t {
        return Err(Failure::Variable);
    }
    if value.len == 0 {
        return Ok(&[]);
    }
    // SAFETY: non-empty, allocated in the request's pool, which outlives
    // the phase handler that asks for it.
    Ok(unsafe { std::slice::from_raw_parts(value.data, value.len) })
}

/// The zone's key for this request (empty: not limited). The bytes live in
/// the request's pool.
pub fn key<'r>(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    zone: usize,
) -> Result<&'r [u8], Failure> {
    let zone = mcf.zones.get(zone).ok_or(Failure::NoZone)?;
    read(r, zone.key)
}
