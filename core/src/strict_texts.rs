//! The text a strict call writer keeps from call to call (`Call::write`).

use super::{Group, Kind};
use crate::key::EntryId;
use crate::resp::{self, Digits};

/// Text a writer keeps from call to call: a link's calls mostly have one
/// rate and one window, whose numbers are written once and copied after.
#[derive(Debug, Default)]
pub struct Texts {
    /// The rate (limit, period) and kind of `rate_text`; `None`: none
    /// yet.
    pub(super) rate: Option<(u32, u32, Kind)>,
    /// A rate's three arguments (limit, period, TTL: the last three of
    /// `Group::limit_args`).
    pub(super) rate_text: smallvec::SmallVec<[u8; 64]>,
    /// The window (period, index) of the tails, or for a bucket's its
    /// period and limit, and the kind; `None`: none yet.
    pub(super) window: Option<(u32, u64, Kind)>,
    /// How a key's name ends after its tag: `}:<period>:<start>` and CRLF,
    /// for the window's counter, then for the one before (a bucket's:
    /// `}:<period>:b<limit>`, twice; a conn group's `}:conn`, twice).
    pub(super) tails: [smallvec::SmallVec<[u8; 40]>; 2],
    /// The last call of one group: its text up to its arguments, of the
    /// shape (period, window, requests, whether `TIME` is read) and for
    /// the prefix and tag (`one_name`: `<prefix>{<tag>`) it was written
    /// for.
    pub(super) one: Vec<u8>,
    pub(super) one_shape: Option<(u32, u64, usize, bool, Kind, u32)>,
    pub(super) one_name: Vec<u8>,
    /// The group's `key`, if it had one.
    pub(super) one_key: Option<EntryId>,
    /// The text of the last deadline but its last digits.
    pub(super) deadline: resp::Near,
}

impl Texts {
    /// The tails of a group's two keys.
    #[inline(always)]
    pub(super) fn tails(&mut self, g: &Group) -> (&[u8], &[u8]) {
        let at = if g.kind == Kind::Window { g.window } else { u64::from(g.limit) };
        if self.window != Some((g.period, at, g.kind)) {
            let (cur, prev) = g.starts();
            let p = Digits::of(g.period.into());
            for (tail, start) in self.tails.iter_mut().zip([cur, prev]) {
                tail.clear();
                tail.extend_from_slice(b"}:");
                match g.kind {
                    Kind::Conn => tail.extend_from_slice(b"conn"),
                    Kind::Bucket(_) => {
                        tail.extend_from_slice(p.as_bytes());
                        tail.extend_from_slice(b":b");
                        tail.extend_from_slice(Digits::of(at).as_bytes());
                    }
                    Kind::Window => {
                        tail.extend_from_slice(p.as_bytes());
                        tail.push(b':');
                        tail.extend_from_slice(Digits::of(start).as_bytes());
                    }
                }
                tail.extend_from_slice(b"\r\n");
            }
            self.window = Some((g.period, at, g.kind));
        }
        (&self.tails[0], &self.tails[1])
    }

    /// Whether `one` was written for this prefix and group's tag: by the
    /// group's key if both have one, else by their bytes.
    #[inline(always)]
    pub(super) fn one_names(&self, prefix: &[u8], g: &Group) -> bool {
        if let (Some(a), Some(b)) = (g.key, self.one_key) {
            return a == b;
        }
        let (n, tag) = (&self.one_name, g.tag);
        n.len() == prefix.len() + 1 + tag.len()
            && n[..prefix.len()] == *prefix
            && n[prefix.len() + 1..] == *tag
    }
}
