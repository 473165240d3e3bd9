//! What a request weighs (`cost=`): the number written in the configuration,
//! or a variable's value read per request (a client's `X-Items`, an
//! upstream's `X-Tokens`).

/// The most a request may weigh.
pub const MAX_COST: u32 = 1_000_000;

/// A cost written in the configuration: decimal digits, 0 to `MAX_COST`.
/// Anything else is a configuration error.
pub fn parse(v: &[u8]) -> Option<u32> {
    match of_value(v) {
        Value::Given(c) => Some(c),
        Value::Empty | Value::Saturated | Value::Malformed => None,
    }
}

/// A cost read from a variable, for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Value {
    /// Decimal digits from 0 to `MAX_COST`: that weight.
    Given(u32),
    /// Empty (the variable is not set): the usual weight, 1.
    Empty,
    /// Decimal digits above `MAX_COST`: weighs `MAX_COST`, so a response
    /// larger than the largest cost still counts as much as a cost can.
    Saturated,
    /// Anything else (a sign, a fraction, an exponent, hex, text, spaces):
    /// weighs 1, as a request without a cost does. Logged.
    Malformed,
}

impl Value {
    /// The weight the request counts with.
    pub fn weight(self) -> u32 {
        match self {
            Value::Given(c) => c,
            Value::Empty | Value::Malformed => 1,
            Value::Saturated => MAX_COST,
        }
    }
}

/// Reads a variable's value as a cost.
pub fn of_value(v: &[u8]) -> Value {
    if v.is_empty() {
        return Value::Empty;
    }
    if !v.iter().all(u8::is_ascii_digit) {
        return Value::Malformed;
    }
    let mut c: u64 = 0;
    for &d in v {
        c = c * 10 + u64::from(d - b'0');
        if c > u64::from(MAX_COST) {
            return Value::Saturated;
        }
    }
    Value::Given(c as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_up_to_the_maximum_are_the_weight() {
        assert_eq!(of_value(b"0"), Value::Given(0));
        assert_eq!(of_value(b"7"), Value::Given(7));
        assert_eq!(of_value(b"007"), Value::Given(7));
        assert_eq!(of_value(b"1000000"), Value::Given(MAX_COST));
        assert_eq!(of_value(b"0000000000000000000001000000"), Value::Given(MAX_COST));
    }

    #[test]
    fn above_the_maximum_saturates_however_long() {
        for v in [&b"1000001"[..], b"99999999999", b"18446744073709551616", &[b'9'; 400]] {
            assert_eq!(of_value(v), Value::Saturated, "{}", String::from_utf8_lossy(v));
            assert_eq!(of_value(v).weight(), MAX_COST);
        }
    }

    #[test]
    fn anything_else_weighs_one() {
        for v in [&b"-5"[..], b"+5", b"0x10", b"1e9", b"1.5", b" 5", b"5 ", b"five", b"\xff"] {
            assert_eq!(of_value(v), Value::Malformed, "{}", String::from_utf8_lossy(v));
            assert_eq!(of_value(v).weight(), 1);
        }
        assert_eq!(of_value(b""), Value::Empty);
        assert_eq!(of_value(b"").weight(), 1);
    }

    #[test]
    fn the_configuration_takes_only_costs_in_range() {
        assert_eq!(parse(b"0"), Some(0));
        assert_eq!(parse(b"50"), Some(50));
        assert_eq!(parse(b"1000000"), Some(MAX_COST));
        assert_eq!(parse(b"1000001"), None);
        assert_eq!(parse(b"-1"), None);
        assert_eq!(parse(b""), None);
    }
}
