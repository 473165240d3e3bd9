//! A rejection's problem details (`redis_ratelimit_problem on`): an
//! RFC 9457 body of draft-ietf-httpapi-ratelimit-headers' problem type
//! `quota-exceeded`, naming the policies the request broke (as the
//! `RateLimit-Policy` header names them).

use std::fmt::Write;

/// The body's media type.
pub const MEDIA_TYPE: &str = "application/problem+json";

/// The problem type the draft registers for a request over its quota.
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The body: its type, title and status, and `violated-policies`.
pub fn body(status: u16, policies: &[String]) -> String {
    let mut out = String::with_capacity(200);
    let _ = write!(
        out,
        "{{\"type\":\"{QUOTA_EXCEEDED}\",\"title\":\"Request cannot be satisfied as assigned quota has been exceeded\",\"status\":{status},\"violated-policies\":["
    );
    for (i, p) in policies.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&crate::text::json_string(p));
    }
    out.push_str("]}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_names_the_type_the_status_and_the_policies() {
        let b = body(429, &["login".to_string(), "a\"b".to_string()]);
        assert_eq!(
            b,
            "{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
             \"title\":\"Request cannot be satisfied as assigned quota has been exceeded\",\
             \"status\":429,\"violated-policies\":[\"login\",\"a\\\"b\"]}\n"
        );
    }
}
