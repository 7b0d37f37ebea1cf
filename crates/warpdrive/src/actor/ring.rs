//! The rings' format, shared by host threads, the CPU backend's loop and the resident
//! kernel (`kernels/actor_loop.cu` holds the same layout in CUDA C).
//!
//! A slot is a run of 64-bit words, each 4 payload bytes (low half) and a flag (high half),
//! as NCCL's LL protocol: a reader sees payload and validity in one load of each word, never
//! a sequence number first and the payload after (a second round trip over PCIe). The flag
//! of message `seq` is `seq as u32 | 1`: never 0 (fresh memory), and different from the
//! flag of the message one lap earlier or later in the same slot, so a reader also tells a
//! slot not written yet from one overwritten by a later lap (`DropOldest`).
//!
//! A slot's payload is an 8-byte header (correlation id, then the lane on the way in or 0
//! on the way out) and the message.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of header before each message in a slot.
pub(crate) const HEADER_BYTES: usize = 8;

/// Words of one slot holding a message of `message_bytes` (an even count: readers load
/// 16 bytes at a time).
pub(crate) fn slot_words(message_bytes: usize) -> usize {
    (HEADER_BYTES + message_bytes)
        .div_ceil(4)
        .next_multiple_of(2)
}

/// The flag of message `seq`.
pub(crate) fn flag(seq: u64) -> u32 {
    seq as u32 | 1
}

/// What a reader found in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// The message it expected, whole.
    Ready,
    /// Not written yet (or being written).
    Empty,
    /// Every word holds a later lap's message: the one expected was overwritten.
    Overwritten,
}

/// Control words at the start of each actor's shared block (the kernel reads the same
/// indices).
pub(crate) mod ctrl {
    /// Host → loop: 1 while the actor should process messages.
    pub(crate) const COMMAND: usize = 0;
    /// Loop → host: the command it last acted on (bit 0) and 2 while parked.
    pub(crate) const STATUS: usize = 1;
    /// Host → loop: replies the host has taken from the outbox.
    pub(crate) const OUT_HEAD: usize = 2;
    /// Loop → host: messages taken from inbox lane `l` are at `IN_HEAD + l`.
    pub(crate) const IN_HEAD: usize = 3;
    /// Loop → host counters.
    pub(crate) const PROCESSED: usize = 9;
    pub(crate) const DROPPED: usize = 10;
    pub(crate) const BUSY_NS: usize = 12;
    pub(crate) const LOOPS: usize = 13;
    /// Loop → host: replies written to the outbox.
    pub(crate) const OUT_TAIL: usize = 14;
    /// Loop → host: messages forwarded to the next actor.
    pub(crate) const FORWARDED: usize = 15;
    /// Loop → host: nanoseconds of the loop's clock when it started (telemetry).
    pub(crate) const CLOCK_START: usize = 16;
    /// Loop → host: sampled message records written to the trace ring.
    pub(crate) const TRACE_TAIL: usize = 17;
    /// Loop → host: nanoseconds spent in each of the 5 phases of an iteration
    /// (`ActorStats::phase_ns`, words 18 to 22), published with `LOOPS`.
    pub(crate) const PHASE_NS: usize = 18;
    /// Loop → host: the wait after answering every message seen before the next read
    /// (`ActorStats::gap_ns`), published with `LOOPS`.
    pub(crate) const GAP_NS: usize = 23;
    /// Loop → host: reads right after that wait which found a message (hits) and which found
    /// none while the read after them did (misses; `ActorStats::gap_reads`), published with
    /// `LOOPS`.
    pub(crate) const GAP_READS: usize = 24;
    /// Loop → host: the first lane's read window summed over iterations, and the iterations
    /// that took messages (`ActorStats::{window_slots, busy_loops}`, words 26 and 27),
    /// published with `LOOPS`.
    pub(crate) const WINDOW_SLOTS: usize = 26;
    /// Host → loop: the sequence numbers senders have claimed in lane `l`, at `TAIL_HINT + l`
    /// (`ActorSpec::tail_hint`; never lower than before, possibly ahead of the slots written,
    /// behind the claims while at most two messages wait): the loop sizes its next window by
    /// it. In the last cache line, away from the heads every sender reads (`IN_HEAD`) and the
    /// command the loop reads each iteration.
    pub(crate) const TAIL_HINT: usize = 28;
    /// Words of the control block.
    pub(crate) const WORDS: usize = 32;
}

// Every lane's tail hint fits the control block, past the loop's counters, in a 64-byte line
// apart from the heads and the command.
const _: () = {
    assert!(ctrl::TAIL_HINT + super::MAX_LANES <= ctrl::WORDS);
    assert!(ctrl::WINDOW_SLOTS + 2 <= ctrl::TAIL_HINT);
    assert!(ctrl::TAIL_HINT / 8 != ctrl::IN_HEAD / 8 && ctrl::TAIL_HINT / 8 != ctrl::COMMAND / 8);
};

/// Control words of the whole system, in their own shared block.
pub(crate) mod sys {
    /// Host → loop: 1 to end the loop.
    pub(crate) const COMMAND: usize = 0;
    /// Host → loop: bumped by the host's watcher while the host is alive.
    pub(crate) const HOST_BEAT: usize = 1;
    /// Host → loop: nanoseconds without a host beat after which the loop parks.
    pub(crate) const PARK_NS: usize = 2;
    /// Loop → host: bumped while the loop runs.
    pub(crate) const LOOP_BEAT: usize = 3;
    /// Loop → host: 1 while parked for want of a host beat.
    pub(crate) const PARKED: usize = 4;
    /// Host → loop: a calibration request (a new number each time).
    pub(crate) const CAL_REQ: usize = 6;
    /// Loop → host: the request answered last, and the loop's clock when it answered
    /// (written before the answer).
    pub(crate) const CAL_ACK: usize = 7;
    pub(crate) const CAL_NS: usize = 8;
    /// Words of the block.
    pub(crate) const WORDS: usize = 16;
}

/// Records in each actor's trace ring (a power of two), and words per record: correlation
/// id and lane, then the loop's clock when the message was read, handled and answered.
pub(crate) const TRACE_SLOTS: usize = 1024;
pub(crate) const TRACE_WORDS: usize = 4;

/// A ring of `capacity` slots of `slot_words` words at `base` in a block of words.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ring {
    pub(crate) base: usize,
    pub(crate) capacity: usize,
    pub(crate) slot_words: usize,
}

impl Ring {
    /// Words the ring takes.
    pub(crate) fn words(&self) -> usize {
        self.capacity * self.slot_words
    }

    fn slot(&self, seq: u64) -> usize {
        self.base + (seq as usize & (self.capacity - 1)) * self.slot_words
    }

    /// Word `i` of message `seq`'s slot: `header`, then `body` zero padded.
    fn word(seq: u64, i: usize, header: [u32; 2], body: &[u8]) -> u64 {
        let data = match i {
            0 | 1 => header[i],
            _ => {
                let from = (i - 2) * 4;
                let mut b = [0u8; 4];
                if from < body.len() {
                    let n = (body.len() - from).min(4);
                    b[..n].copy_from_slice(&body[from..from + n]);
                }
                u32::from_le_bytes(b)
            }
        };
        (flag(seq) as u64) << 32 | data as u64
    }

    /// Writes message `seq`: `header` and `body` (at most the slot's payload, zero padded).
    pub(crate) fn write(&self, words: &[AtomicU64], seq: u64, header: [u32; 2], body: &[u8]) {
        let at = self.slot(seq);
        for (i, w) in words[at..at + self.slot_words].iter().enumerate() {
            w.store(Self::word(seq, i, header, body), Ordering::Release);
        }
    }

    /// Writes message `seq` as `write` does, but its second half first, then `between`, then
    /// the first half (header included): a slot torn for as long as `between` runs, which a
    /// reader must take for not written (`Actor::send_many_slowly`).
    pub(crate) fn write_torn(
        &self,
        words: &[AtomicU64],
        seq: u64,
        header: [u32; 2],
        body: &[u8],
        between: &mut dyn FnMut(),
    ) {
        let at = self.slot(seq);
        let half = self.slot_words / 2;
        for i in half..self.slot_words {
            words[at + i].store(Self::word(seq, i, header, body), Ordering::Release);
        }
        between();
        for i in 0..half {
            words[at + i].store(Self::word(seq, i, header, body), Ordering::Release);
        }
    }

    /// Reads message `seq` into `header` and `body` (`body` as long as the message); on
    /// `Empty` they hold whatever was read before the first word not written yet.
    pub(crate) fn read(
        &self,
        words: &[AtomicU64],
        seq: u64,
        header: &mut [u32; 2],
        body: &mut [u8],
    ) -> Found {
        let want = flag(seq);
        let at = self.slot(seq);
        let mut newer = false;
        for (i, w) in words[at..at + self.slot_words].iter().enumerate() {
            let v = w.load(Ordering::Acquire);
            let d = ((v >> 32) as u32).wrapping_sub(want) as i32;
            // A word not written yet makes the slot empty whatever the others hold: a poller
            // waiting for a reply reads one word, not the slot.
            if d < 0 {
                return Found::Empty;
            }
            newer |= d > 0;
            let data = (v as u32).to_le_bytes();
            match i {
                0 | 1 => header[i] = v as u32,
                _ => {
                    let from = (i - 2) * 4;
                    if from < body.len() {
                        let n = (body.len() - from).min(4);
                        body[from..from + n].copy_from_slice(&data[..n]);
                    }
                }
            }
        }
        if newer {
            Found::Overwritten
        } else {
            Found::Ready
        }
    }

    /// True when every word of the slot of `seq` holds message `seq` or a later lap's.
    pub(crate) fn written_since(&self, words: &[AtomicU64], seq: u64) -> bool {
        let mut header = [0u32; 2];
        !matches!(self.read(words, seq, &mut header, &mut []), Found::Empty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn slots_round_trip_and_tell_laps_apart() {
        let ring = Ring {
            base: 3,
            capacity: 4,
            slot_words: slot_words(9),
        };
        assert_eq!(ring.slot_words, 6);
        let words = block(3 + ring.words());
        let (mut h, mut b) = ([0u32; 2], [0u8; 9]);
        assert_eq!(ring.read(&words, 1, &mut h, &mut b), Found::Empty);
        let body: Vec<u8> = (1..=9).collect();
        ring.write(&words, 1, [7, 2], &body);
        assert_eq!(ring.read(&words, 1, &mut h, &mut b), Found::Ready);
        assert_eq!((h, b.to_vec()), ([7, 2], body.clone()));
        // The slot of seq 1 one lap later: not written yet, then overwritten for seq 1.
        assert_eq!(ring.read(&words, 5, &mut h, &mut b), Found::Empty);
        ring.write(&words, 5, [8, 0], &body);
        assert_eq!(ring.read(&words, 1, &mut h, &mut b), Found::Overwritten);
        assert_eq!(ring.read(&words, 5, &mut h, &mut b), Found::Ready);
        // A half-written slot is not ready.
        words[ring.slot(9) + 4].store((flag(9) as u64) << 32, Ordering::Relaxed);
        assert_eq!(ring.read(&words, 9, &mut h, &mut b), Found::Empty);
    }

    #[test]
    fn a_torn_slot_reads_as_not_written_until_whole() {
        let ring = Ring {
            base: 0,
            capacity: 4,
            slot_words: slot_words(12),
        };
        let words = block(ring.words());
        let body: Vec<u8> = (1..=12).collect();
        let (mut h, mut b) = ([0u32; 2], [0u8; 12]);
        let mut seen = None;
        ring.write_torn(&words, 6, [9, 1], &body, &mut || {
            seen = Some(ring.read(&words, 6, &mut [0u32; 2], &mut [0u8; 12]));
        });
        assert_eq!(seen, Some(Found::Empty));
        assert_eq!(ring.read(&words, 6, &mut h, &mut b), Found::Ready);
        assert_eq!((h, b.to_vec()), ([9, 1], body));
    }

    #[test]
    fn flags_survive_wrapping() {
        let cap = 16u64;
        for seq in [0u64, 1, u32::MAX as u64 - 3, u32::MAX as u64 + 5, 1 << 40] {
            assert_ne!(flag(seq), 0);
            let d = flag(seq + cap).wrapping_sub(flag(seq)) as i32;
            assert!(d > 0, "{seq}");
        }
    }
}
