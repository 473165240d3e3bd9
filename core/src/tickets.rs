//! Tickets: the numbers that name a worker's waiting requests in the
//! answers that wake them. A ticket's base says the slot its request is
//! in, so finding a request is an index and a compare (no hashing), and a
//! freed slot is used again; the rest of the base is a serial number, so
//! a slot used again never answers to an older ticket. The low bits of a
//! ticket are the caller's (which of a request's limits it is for).

/// A waiting request's name in the answers that wake it: its base (which
/// `Tickets::insert` gives), and in its low bits which of the request's
/// limits the answer is for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Ticket(pub u64);

impl Ticket {
    /// This ticket (a base) for the request's limit `k` (its low bits).
    #[inline]
    pub fn for_limit(self, k: u64) -> Ticket {
        Ticket(self.0 | k)
    }
}

/// The ticket that names no request (a count nobody waits for): never a
/// base, never found.
pub const NO_TICKET: Ticket = Ticket(0);

/// Bits of a base that say its slot.
const SLOT_BITS: u32 = 32;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;

/// Requests by ticket base; `T` is how the caller finds a request.
#[derive(Debug)]
pub struct Tickets<T> {
    /// Per slot: the base of the request in it (`NO_TICKET`: free), and
    /// the request.
    slots: Vec<(u64, Option<T>)>,
    free: Vec<u32>,
    serial: u64,
    /// The low bits of a ticket that are the caller's.
    low_bits: u32,
}

impl<T: Copy> Tickets<T> {
    /// Tickets whose `low_bits` lowest bits are the caller's (at most 16).
    pub const fn new(low_bits: u32) -> Tickets<T> {
        assert!(low_bits <= 16);
        Tickets { slots: Vec::new(), free: Vec::new(), serial: 0, low_bits }
    }

    /// Lists `v`; returns its tickets' base (its low bits 0, never
    /// `NO_TICKET`).
    pub fn insert(&mut self, v: T) -> Ticket {
        // serial numbers 1 ..= 2^(64 - 32 - low_bits) - 1, then again
        let serials = 1u64 << (64 - SLOT_BITS - self.low_bits);
        self.serial = self.serial % (serials - 1) + 1;
        let slot = match self.free.pop() {
            Some(s) => s as usize,
            None => {
                self.slots.push((NO_TICKET.0, None));
                self.slots.len() - 1
            }
        };
        let base = ((self.serial << SLOT_BITS) | slot as u64) << self.low_bits;
        self.slots[slot] = (base, Some(v));
        Ticket(base)
    }

    /// The base of `ticket` (its low bits cleared).
    #[inline]
    fn base(&self, ticket: Ticket) -> u64 {
        ticket.0 >> self.low_bits << self.low_bits
    }

    /// What is listed under `ticket`'s base, if it still is.
    #[inline]
    pub fn get(&self, ticket: Ticket) -> Option<T> {
        let base = self.base(ticket);
        let s = self.slots.get(self.slot(base))?;
        if s.0 == base && base != NO_TICKET.0 {
            s.1
        } else {
            None
        }
    }

    /// Takes out what is listed under `ticket`'s base, if it still is.
    pub fn remove(&mut self, ticket: Ticket) -> Option<T> {
        let base = self.base(ticket);
        let slot = self.slot(base);
        let s = self.slots.get_mut(slot).filter(|s| s.0 == base && base != NO_TICKET.0)?;
        let v = s.1.take();
        s.0 = NO_TICKET.0;
        self.free.push(slot as u32);
        v
    }

    /// How many are listed.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn slot(&self, base: u64) -> usize {
        ((base >> self.low_bits) & SLOT_MASK) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_finds_its_request_until_it_is_taken_out() {
        let mut t: Tickets<u32> = Tickets::new(4);
        let a = t.insert(10);
        let b = t.insert(20);
        assert_ne!(a, b);
        assert_eq!(a.0 & 0xf, 0, "the low bits are the caller's");
        assert_eq!(
            (t.get(a), t.get(b.for_limit(3)), t.get(a.for_limit(15))),
            (Some(10), Some(20), Some(10))
        );
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(a.for_limit(2)), Some(10));
        assert_eq!((t.get(a), t.remove(a)), (None, None), "gone, and taken out once");
        assert_eq!(t.get(b), Some(20));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_slot_used_again_does_not_answer_an_older_ticket() {
        let mut t: Tickets<u32> = Tickets::new(4);
        let old = t.insert(1);
        t.remove(old);
        let new = t.insert(2);
        assert_eq!(new.0 >> 4 & SLOT_MASK, old.0 >> 4 & SLOT_MASK, "the same slot");
        assert_ne!(new, old);
        assert_eq!((t.get(old), t.get(new)), (None, Some(2)));
        assert_eq!(t.remove(old), None, "a late answer takes nothing out");
        assert_eq!(t.get(new), Some(2));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn no_ticket_is_never_a_request_not_even_of_a_free_slot() {
        let mut t: Tickets<u32> = Tickets::new(4);
        assert_eq!(t.get(NO_TICKET), None);
        let a = t.insert(1);
        assert_ne!(a, NO_TICKET);
        t.remove(a);
        // slot 0 is free now: its base is NO_TICKET
        assert_eq!((t.get(NO_TICKET), t.remove(NO_TICKET)), (None, None));
        assert_eq!(t.get(NO_TICKET.for_limit(3)), None, "nor with low bits");
        // the free list was not doubled: two inserts take two slots
        let (x, y) = (t.insert(7), t.insert(8));
        assert_ne!(x.0 >> 4 & SLOT_MASK, y.0 >> 4 & SLOT_MASK);
        assert_eq!((t.get(x), t.get(y), t.len()), (Some(7), Some(8), 2));
    }

    #[test]
    fn serial_numbers_wrap_without_reaching_zero() {
        let mut t: Tickets<u32> = Tickets::new(16);
        t.serial = (1 << 16) - 2;
        let a = t.insert(1);
        t.remove(a);
        let b = t.insert(2);
        t.remove(b);
        let c = t.insert(3);
        assert_eq!(b.0 >> 48, 1, "wrapped to 1, not 0");
        assert!(a != b && b != c && c != NO_TICKET);
        assert_eq!((t.get(a), t.get(b), t.get(c)), (None, None, Some(3)));
    }

    #[test]
    fn many_requests_in_and_out_keep_their_own_tickets() {
        let mut t: Tickets<u32> = Tickets::new(4);
        let mut listed: Vec<(Ticket, u32)> = Vec::new();
        let mut seed = 12345u64;
        for i in 0..10_000u32 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            if seed >> 62 == 0 && !listed.is_empty() {
                let (k, v) = listed.swap_remove((seed >> 20) as usize % listed.len());
                assert_eq!(t.remove(k), Some(v));
                assert_eq!(t.get(k), None);
            } else {
                listed.push((t.insert(i), i));
            }
        }
        assert_eq!(t.len(), listed.len());
        for (k, v) in listed {
            assert_eq!(t.get(k.for_limit(1)), Some(v));
        }
    }
}
