//! What the script answers for a call, read group by group (`strict.rs`
//! says what it is given and what it answers).

/// What Redis answered for a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The current window's count after the call (ours included).
    pub cur: u64,
    /// The previous window's count.
    pub prev: u64,
    /// One per request of the group, in order: allowed (and counted) or
    /// not; `None` when the script ran after the request's deadline (not
    /// checked, not counted: `on_error` decided it).
    pub allowed: smallvec::SmallVec<[Option<bool>; 4]>,
}

/// What a group's answer says: Redis's counts, and each request's
/// verdict.
pub trait Verdicts {
    /// The current window's count after the call (ours included).
    fn cur(&self) -> u64;
    /// The previous window's count.
    fn prev(&self) -> u64;
    /// Request `i` of the group: allowed (and counted) or not; `None` when
    /// the script ran after its deadline (or there is no such request).
    fn allowed(&self, i: usize) -> Option<bool>;
}

impl Verdicts for Answer {
    fn cur(&self) -> u64 {
        self.cur
    }
    fn prev(&self) -> u64 {
        self.prev
    }
    fn allowed(&self, i: usize) -> Option<bool> {
        self.allowed.get(i).copied().flatten()
    }
}

/// A group's part of a call's answer, read where it is (the call's
/// integers), its flags checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part<'v> {
    cur: u64,
    prev: u64,
    /// One per request: 1 allowed, 0 not, 2 after its deadline.
    flags: &'v [i64],
}

impl<'v> Part<'v> {
    /// Reads one group's part, checking that it has one flag per request:
    /// anything else is `None` (the group fails, and its requests are
    /// decided by `on_error`).
    pub fn read(values: &'v [i64], requests: usize) -> Option<Part<'v>> {
        let (&cur, rest) = values.split_first()?;
        let (&prev, flags) = rest.split_first()?;
        if flags.len() != requests
            || cur < 0
            || prev < 0
            || flags.iter().any(|&f| !(0..=2).contains(&f))
        {
            return None;
        }
        Some(Part { cur: cur as u64, prev: prev as u64, flags })
    }

    /// As an `Answer` of its own.
    pub fn to_answer(&self) -> Answer {
        let allowed = (0..self.flags.len()).map(|i| self.allowed(i)).collect();
        Answer { cur: self.cur, prev: self.prev, allowed }
    }
}

impl Verdicts for Part<'_> {
    fn cur(&self) -> u64 {
        self.cur
    }
    fn prev(&self) -> u64 {
        self.prev
    }
    #[inline]
    fn allowed(&self, i: usize) -> Option<bool> {
        match self.flags.get(i) {
            Some(1) => Some(true),
            Some(0) => Some(false),
            _ => None,
        }
    }
}

/// What a call's answer says of one of its groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome<'v> {
    Answer(Part<'v>),
    /// It failed after another group of the call counted: nothing was
    /// counted for it, and a call of its own gets its error.
    Alone,
    /// Not what the script answers: its requests are decided by
    /// `on_error`.
    Bad,
}

/// A call's answer (the integers of the script's array) read group by
/// group, in the call's order. An answer of another length than its
/// groups' is `Bad` for all.
pub struct Answers<'v> {
    rest: &'v [i64],
    whole: bool,
}

impl<'v> Answers<'v> {
    /// `values` for a call of `groups` groups with `requests` requests in
    /// all.
    pub fn new(values: &'v [i64], groups: usize, requests: usize) -> Answers<'v> {
        Answers { rest: values, whole: values.len() == 2 * groups + requests }
    }

    /// The next group's outcome (`requests`: its number of requests).
    pub fn next(&mut self, requests: usize) -> Outcome<'v> {
        if !self.whole || self.rest.len() < 2 + requests {
            return Outcome::Bad;
        }
        let (part, rest) = self.rest.split_at(2 + requests);
        self.rest = rest;
        match part {
            [-1, ..] => Outcome::Alone,
            _ => Part::read(part, requests).map_or(Outcome::Bad, Outcome::Answer),
        }
    }
}

/// Reads one group's part of the answer (`Part::read`) as an `Answer`.
pub fn parse_answer(values: &[i64], requests: usize) -> Option<Answer> {
    Part::read(values, requests).map(|p| p.to_answer())
}
