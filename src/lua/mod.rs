//! The Lua ABI: C functions that `lua/resty/redis_ratelimit.lua` binds to
//! through LuaJIT's FFI (nginx loads modules with `RTLD_GLOBAL`, so `ffi.C`
//! finds them). They ask the same engine as the preaccess handler.

mod controls;
mod ffi;
