//! When busy polling may spin: only while the spinning thread has a core to itself.
//!
//! Busy polling trades a core for wakeup latency, which pays when a core is idle anyway.
//! When threads outnumber cores, the spinner holds the core its own peer (the fio thread,
//! the target's worker) needs to produce the very packet it waits for, and every empty poll
//! is a syscall: on the 2-core test machine at load 8, 4 KiB QD32 through the plugin and an
//! `nvmf-rdma target` cost 9.9 µs of CPU per I/O with 50 µs busy polling and 6.1 µs without
//! it, at 0.56x the IOPS (docs/performance.md). The sign of that is the spinning thread
//! being preempted: the kernel only takes a core from a runnable thread when another one
//! wants it. So while spinning, every [`CHECK_EVERY`] the driver reads its thread's
//! involuntary context switches; if that count rose since the last check (a reading at most
//! [`STALE`] old, so idle spells are not held against it), it stops spinning
//! for [`HOLD_OFF`] (it sleeps in epoll between turns, as with busy polling off) and then
//! tries again. On a machine with a spare core nothing preempts the spinner and busy
//! polling behaves as before.
//! Only turns of [`BATCHED`] packets or more are held off: at QD1 (a packet or two a turn)
//! the wakeup is the round trip, and holding off there lost QD1 IOPS at load 3-5.
//!
//! [`SpinGate`] is the policy, with no clock and no syscalls of its own: the driver passes
//! `now` and a way to read the counter.

use std::time::{Duration, Instant};

/// How often a spinning driver looks at its preemption count.
pub(crate) const CHECK_EVERY: Duration = Duration::from_millis(1);
/// A reading older than this is not compared (the driver slept through an idle spell).
pub(crate) const STALE: Duration = Duration::from_millis(10);
/// Packets per turn from which a preempted spinner is held off (see [`SpinGate::allow`]).
pub(crate) const BATCHED: u64 = 8;
/// How long busy polling stays off after the spinner was preempted.
pub(crate) const HOLD_OFF: Duration = Duration::from_millis(100);

/// A count of the calling thread's involuntary context switches, with the thread it was read
/// on (a multi-thread runtime may move the driver task between threads, and counts of two
/// threads do not compare).
pub(crate) type Preemptions = (std::thread::ThreadId, u64);

/// The calling thread's involuntary context switches (`getrusage(RUSAGE_THREAD)`), or
/// `None` where the kernel does not say.
pub(crate) fn thread_preemptions() -> Option<Preemptions> {
    // SAFETY: getrusage writes one rusage struct we own.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) } != 0 {
        return None;
    }
    Some((
        std::thread::current().id(),
        u64::try_from(u.ru_nivcsw).ok()?,
    ))
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct SpinGate {
    /// No spinning before this.
    hold_until: Option<Instant>,
    /// The last reading, and when it was taken.
    last: Option<(Preemptions, Instant)>,
    /// Packets per turn that moved any, averaged (x8, an exponential average of weight 1/8).
    avg_x8: u64,
    /// Times busy polling was turned off for a while (for tests and stats).
    pub(crate) holds: u64,
}

impl SpinGate {
    /// May the driver spin after a turn that moved packets at `now`? `read` is called at most
    /// once per [`CHECK_EVERY`]. Spin windows at QD32 are often shorter than that (a window
    /// ends 50 µs after the last packet), so a reading outlives a window and is compared
    /// with the next one's; one older than [`STALE`] (an idle spell) is only replaced.
    ///
    /// `packets`: what the turn received and sent. Only while turns average [`BATCHED`]
    /// packets or more is the spinner held off: a turn of many packets pays one wakeup for
    /// all of them, so spinning buys little there (queue depth), while at one or two packets
    /// a turn (QD1) the wakeup is most of the round trip and spinning stays on.
    pub(crate) fn allow(
        &mut self,
        now: Instant,
        packets: usize,
        read: impl FnOnce() -> Option<Preemptions>,
    ) -> bool {
        let p = u64::try_from(packets).unwrap_or(u64::MAX).min(1 << 20);
        self.avg_x8 = self.avg_x8 - self.avg_x8 / 8 + p;
        if self.avg_x8 < BATCHED * 8 {
            self.hold_until = None;
            self.last = None;
            return true;
        }
        if let Some(t) = self.hold_until {
            if now < t {
                return false;
            }
            self.hold_until = None;
        }
        match self.last {
            Some((_, at)) if now < at + CHECK_EVERY => true,
            Some(((tid, before), at)) if now < at + STALE => match read() {
                Some((t, after)) if t == tid && after > before => {
                    self.hold_until = Some(now + HOLD_OFF);
                    self.last = None;
                    self.holds += 1;
                    false
                }
                p => {
                    self.last = p.map(|p| (p, now));
                    true
                }
            },
            _ => {
                self.last = read().map(|p| (p, now));
                true
            }
        }
    }
}

/// How long busy polling stays off after a lone spell that no answer ended; each further
/// miss soon after doubles it, up to [`UNANSWERED_HOLD_OFF`].
pub(crate) const FIRST_HOLD_OFF: Duration = Duration::from_millis(1);
/// The longest busy polling stays off after spells that went unanswered in a row.
pub(crate) const UNANSWERED_HOLD_OFF: Duration = Duration::from_millis(100);
/// Answered spells in a row (no miss among them) that take the hold-off of the next miss
/// one step back down.
pub(crate) const ANSWERED_STEP: u32 = 1024;

/// Busy polling goes on only while it is answered: a spell pays when the packet or post it
/// waits for comes inside the window, and not when it does not, which is what happens when
/// the spinner holds the core its peer needs (threads outnumber cores: the peer is the
/// target's thread in another process, fio's thread, or someone else's work). Across
/// processes on the 2-core machine, 50 µs spells that went on regardless cost 4-50x the
/// IOPS of not polling at all (docs/performance.md, "Across processes"); in one process the
/// peer is a task of the same runtime, which a spinner yields to, so it answers in time.
///
/// A spell that the window's end closes with nothing come turns busy polling off for a
/// while; then it is tried again. The while starts at [`FIRST_HOLD_OFF`] and doubles with
/// each miss up to [`UNANSWERED_HOLD_OFF`]; it halves back for each [`UNANSWERED_HOLD_OFF`]
/// that busy polling was allowed without a miss, and a step for each [`ANSWERED_STEP`]
/// spells answered in a row. So a lone miss (connection setup, a pause of fio's) costs a
/// millisecond, while spinners fighting over the cores, which miss again as soon as they are
/// let spin, are soon held off for the longest and stay so: under contention some spells
/// are answered too, but not a thousand in a row. A QD1 job whose application thread is
/// preempted every 100 ms or so (fio's other threads) misses that often; without the
/// answered steps it would keep the level its connection set-up climbed to, busy polling
/// held off a quarter of the time. A spell cut short by a device deadline (the timer it
/// polls for) says nothing either way. No clock of its own: the driver passes `now`.
#[derive(Debug, Default)]
pub(crate) struct AnswerGate {
    hold_until: Option<Instant>,
    /// The hold-off of the next miss: `FIRST_HOLD_OFF << level`, capped.
    level: u32,
    /// When the last hold-off ended (spinning allowed again).
    last_hold_end: Option<Instant>,
    /// Spells answered since the last miss or step down.
    answered: u32,
    /// Spells that went unanswered (for tests and stats).
    pub(crate) misses: u64,
}

/// How a busy-poll spell ended, for [`AnswerGate::spell_ended`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spell {
    /// A packet or a post came inside the window.
    Answered,
    /// The window passed with nothing come (a late answer counts as none).
    Unanswered,
    /// A device deadline came first, inside the window: no verdict.
    Timer,
    /// The spinner was not running for half the window or more (its runtime was busy
    /// elsewhere: fio's thread between its calls into the plugin, or the runtime's other
    /// tasks): it did not watch the window, so nothing is known about the peer.
    Away,
    /// The window passed, but no packet had crossed the network for a while: the peer is a
    /// task of this runtime (the built-in target, `nvmf-rdma bench`), which the spinner
    /// yields to, so a late answer is not one that wanted a core.
    InProcess,
}

impl AnswerGate {
    /// May the driver start a spell at `now`?
    pub(crate) fn allow(&mut self, now: Instant) -> bool {
        match self.hold_until {
            Some(t) if now < t => false,
            _ => {
                self.hold_until = None;
                true
            }
        }
    }

    /// A spell ended at `now`.
    pub(crate) fn spell_ended(&mut self, now: Instant, how: Spell) {
        match how {
            Spell::Unanswered => {
                if let Some(end) = self.last_hold_end {
                    let quiet = now.saturating_duration_since(end);
                    let steps = quiet.as_nanos() / UNANSWERED_HOLD_OFF.as_nanos();
                    self.level = self
                        .level
                        .saturating_sub(u32::try_from(steps).unwrap_or(u32::MAX));
                }
                let hold = FIRST_HOLD_OFF
                    .saturating_mul(1 << self.level)
                    .min(UNANSWERED_HOLD_OFF);
                self.hold_until = Some(now + hold);
                self.last_hold_end = Some(now + hold);
                if hold < UNANSWERED_HOLD_OFF {
                    self.level += 1;
                }
                self.misses += 1;
                self.answered = 0;
            }
            Spell::Answered => {
                self.answered += 1;
                if self.answered >= ANSWERED_STEP {
                    self.answered = 0;
                    self.level = self.level.saturating_sub(1);
                }
            }
            Spell::Timer | Spell::Away | Spell::InProcess => {}
        }
    }
}

/// What a spinner saw of its spell.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Looked {
    /// A packet or a post ended the spell.
    pub(crate) input: bool,
    /// When it ended.
    pub(crate) at: Instant,
    /// The longest time between two looks at the port (the spinner's task not polled).
    pub(crate) longest_gap: Duration,
    /// Packets crossed the network (another process or machine) within the last
    /// [`UNANSWERED_HOLD_OFF`].
    pub(crate) network_peer: bool,
}

/// How a spell over `window` ended, from what the spinner saw: `input` when a packet or a
/// post ended it, else the window's or a device deadline's end did. A spinner that was not
/// polled for half the window or more gives no verdict: in one process, where the peer is a
/// task of the same runtime, the window runs out while the runtime is away (fio's thread
/// between its calls into the plugin), and counting that against the peer turned busy
/// polling off for nothing.
pub(crate) fn spell(seen: Looked, window: std::ops::Range<Instant>) -> Spell {
    let span = window.end.saturating_duration_since(window.start);
    if seen.longest_gap * 2 >= span {
        return Spell::Away;
    }
    match (seen.input, seen.at < window.end) {
        (true, true) => Spell::Answered,
        (false, true) => Spell::Timer,
        (_, false) if !seen.network_peer => Spell::InProcess,
        (_, false) => Spell::Unanswered,
    }
}

/// How far ahead a device timer is waited for by polling rather than by the runtime's timer.
/// Tokio's timers tick in milliseconds, so a retransmit timeout of 200 µs (the floor of the
/// adaptive one) or an ACK held back 100 µs, once the driver slept, fired a millisecond or
/// two late: under random loss each lost packet cost that stall, not a round trip.
pub(crate) const TIMER_SPIN: Duration = Duration::from_millis(2);
/// Polling goes on this long past the deadline, so the turn that handles it happens while
/// still polling.
const TIMER_SLACK: Duration = Duration::from_micros(20);

/// Where busy polling ends after a turn: `until` (the busy-poll window, or `None` when busy
/// polling is off or held off by [`SpinGate`]), pushed out to just past the device's next
/// deadline when that comes within [`TIMER_SPIN`] of `now`. A device has deadlines only
/// while it owes an ACK or waits for one (its retransmit, tail-loss probe and RNR timers),
/// so this polls through those waits and no longer: an idle device still sleeps once its
/// window ends, and a far deadline (a backed-off retransmit) is left to the runtime.
pub(crate) fn spin_until(
    until: Option<Instant>,
    now: Instant,
    next_deadline: Option<Instant>,
) -> Option<Instant> {
    let until = until?;
    Some(match next_deadline {
        Some(d) if d <= now + TIMER_SPIN => until.max(d + TIMER_SLACK),
        _ => until,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_reaches_past_a_near_device_deadline_and_no_further() {
        let now = Instant::now();
        let window = now + Duration::from_micros(50);
        // A retransmit timer 200 µs away: polled for, so it fires on time.
        let rto = now + Duration::from_micros(200);
        assert_eq!(
            spin_until(Some(window), now, Some(rto)),
            Some(rto + TIMER_SLACK)
        );
        // Exactly at the limit still counts; beyond it the runtime's timer takes it.
        let edge = now + TIMER_SPIN;
        assert_eq!(
            spin_until(Some(window), now, Some(edge)),
            Some(edge + TIMER_SLACK)
        );
        let far = now + TIMER_SPIN + Duration::from_micros(1);
        assert_eq!(spin_until(Some(window), now, Some(far)), Some(window));
        // A deadline inside the window does not shorten it; none leaves it as it is.
        let soon = now + Duration::from_micros(10);
        assert_eq!(spin_until(Some(window), now, Some(soon)), Some(window));
        assert_eq!(spin_until(Some(window), now, None), Some(window));
        // Busy polling off (or held off by the gate): never turned on by a deadline.
        assert_eq!(spin_until(None, now, Some(rto)), None);
    }

    impl SpinGate {
        /// As `allow` after turns of 32 packets (QD32).
        fn allow_b(&mut self, now: Instant, read: impl FnOnce() -> Option<Preemptions>) -> bool {
            self.avg_x8 = self.avg_x8.max(32 * 8);
            self.allow(now, 32, read)
        }
    }

    #[test]
    fn small_turns_keep_spinning_even_when_preempted() {
        let t0 = Instant::now();
        let mut g = SpinGate::default();
        for i in 0..100u32 {
            assert!(g.allow(t0 + CHECK_EVERY * i, 2, || me(u64::from(i))));
        }
        assert_eq!(g.holds, 0);
        // Turns grow (QD32): preemption now holds it off; small turns again end the hold.
        assert!(g.allow_b(t0 + CHECK_EVERY * 200, || me(500)));
        assert!(!g.allow_b(t0 + CHECK_EVERY * 201, || me(501)));
        for _ in 0..30 {
            g.allow(t0 + CHECK_EVERY * 202, 1, || me(501));
        }
        assert!(g.allow(t0 + CHECK_EVERY * 202, 1, || me(502)));
    }

    fn me(n: u64) -> Option<Preemptions> {
        Some((std::thread::current().id(), n))
    }

    #[test]
    fn a_preempted_spinner_stops_spinning_for_the_hold_off() {
        let t0 = Instant::now();
        let mut g = SpinGate::default();
        assert!(g.allow_b(t0, || me(5)));
        // Within CHECK_EVERY nothing is read.
        assert!(g.allow_b(t0 + CHECK_EVERY / 2, || panic!("read too early")));
        // Preempted since the last reading: no spinning, until HOLD_OFF has passed.
        let t1 = t0 + CHECK_EVERY;
        assert!(!g.allow_b(t1, || me(6)));
        assert_eq!(g.holds, 1);
        assert!(!g.allow_b(t1 + HOLD_OFF / 2, || panic!("read while held off")));
        // Then a fresh reading, judged a CHECK_EVERY later.
        assert!(g.allow_b(t1 + HOLD_OFF, || me(6)));
        assert!(g.allow_b(t1 + HOLD_OFF + CHECK_EVERY, || me(6)));
        assert_eq!(g.holds, 1);
    }

    #[test]
    fn a_spinner_never_preempted_keeps_spinning() {
        let t0 = Instant::now();
        let mut g = SpinGate::default();
        assert!(g.allow_b(t0, || me(3)));
        for i in 1..100u32 {
            assert!(g.allow_b(t0 + CHECK_EVERY * i, || me(3)));
        }
        assert_eq!(g.holds, 0);
    }

    #[test]
    fn counts_of_another_thread_or_of_a_stale_reading_are_not_compared() {
        let t0 = Instant::now();
        let mut g = SpinGate::default();
        assert!(g.allow_b(t0, || me(3)));
        let other = std::thread::spawn(|| std::thread::current().id())
            .join()
            .unwrap();
        // Moved to another thread with a higher count: a fresh reading, not a preemption.
        assert!(g.allow_b(t0 + CHECK_EVERY, || Some((other, 50))));
        assert!(g.allow_b(t0 + CHECK_EVERY * 2, || Some((other, 50))));
        // After an idle spell longer than STALE the count may have risen while the driver
        // did not spin: replaced, not compared.
        let t1 = t0 + CHECK_EVERY * 2 + STALE;
        assert!(g.allow_b(t1, || Some((other, 90))));
        assert_eq!(g.holds, 0);
        // Compared again a CHECK_EVERY later.
        assert!(!g.allow_b(t1 + CHECK_EVERY, || Some((other, 91))));
    }

    #[test]
    fn an_unanswered_spell_stops_busy_polling_for_the_hold_off() {
        let t0 = Instant::now();
        let window = Duration::from_micros(50);
        let mut g = AnswerGate::default();
        // Answered spells, and spells a device timer cut short, keep it on.
        for i in 0..10u32 {
            let start = t0 + window * 2 * i;
            assert!(g.allow(start));
            let how = spell(looked(true, start + window / 2), start..start + window);
            assert_eq!(how, Spell::Answered);
            g.spell_ended(start + window / 2, how);
        }
        let start = t0 + window * 20;
        let how = spell(looked(false, start + window / 4), start..start + window);
        assert_eq!(how, Spell::Timer);
        g.spell_ended(start + window / 4, how);
        assert!(g.allow(start + window));
        assert_eq!(g.misses, 0);
        // The window passed with nothing come: off for a millisecond, then tried again.
        let start = t0 + window * 30;
        let end = start + window;
        assert_eq!(spell(looked(false, end), start..end), Spell::Unanswered);
        g.spell_ended(end, Spell::Unanswered);
        assert_eq!(g.misses, 1);
        assert!(!g.allow(end));
        assert!(!g.allow(end + FIRST_HOLD_OFF / 2));
        assert!(g.allow(end + FIRST_HOLD_OFF));
        assert!(g.allow(end + FIRST_HOLD_OFF + window));
    }

    #[test]
    fn misses_in_a_row_hold_busy_polling_off_longer_and_quiet_time_brings_it_back() {
        let mut g = AnswerGate::default();
        let mut now = Instant::now();
        // Spinners that fight over the cores: a spell misses as soon as spinning is let
        // again, answered spells in between. The hold-offs double up to the longest and stay.
        let mut holds = vec![];
        for _ in 0..10 {
            assert!(g.allow(now));
            g.spell_ended(now, Spell::Answered);
            g.spell_ended(now, Spell::Unanswered);
            let mut off = Duration::ZERO;
            while !g.allow(now + off) {
                off += FIRST_HOLD_OFF / 4;
            }
            holds.push(off);
            now += off;
        }
        let ms = |n| FIRST_HOLD_OFF * n;
        assert_eq!(holds[..4], [ms(1), ms(2), ms(4), ms(8)]);
        assert_eq!(holds[7..], [UNANSWERED_HOLD_OFF; 3]);
        // Two hold-offs' worth of spinning without a miss: a miss holds off a quarter as long.
        let now = now + UNANSWERED_HOLD_OFF * 2;
        g.spell_ended(now, Spell::Unanswered);
        assert!(!g.allow(now + ms(31)));
        assert!(g.allow(now + ms(32)));
        // Timers and spells the spinner did not watch change nothing; a long quiet spell
        // brings a miss back to a millisecond.
        let now = now + ms(32);
        g.spell_ended(now, Spell::Timer);
        g.spell_ended(now, Spell::Away);
        g.spell_ended(now, Spell::Unanswered);
        assert!(!g.allow(now + ms(63)));
        assert!(g.allow(now + ms(64)));
        let now = now + ms(64) + UNANSWERED_HOLD_OFF * 20;
        g.spell_ended(now, Spell::Unanswered);
        assert!(g.allow(now + ms(1)));
    }

    /// Misses in a row (connection set-up) climb to a long hold-off; then many answered
    /// spells in a row take it back down, so a lone miss later (the application's thread
    /// preempted) costs a millisecond again, not the level set-up left.
    #[test]
    fn answered_spells_in_a_row_bring_the_hold_off_back_down() {
        let mut g = AnswerGate::default();
        let mut now = Instant::now();
        let hold = |g: &mut AnswerGate, now: Instant| {
            let mut off = Duration::ZERO;
            while !g.allow(now + off) {
                off += FIRST_HOLD_OFF / 4;
            }
            off
        };
        for _ in 0..5 {
            g.spell_ended(now, Spell::Unanswered);
            now += hold(&mut g, now);
        }
        // Spells 20 µs apart, all answered, for well under one UNANSWERED_HOLD_OFF of time.
        let spell = Duration::from_micros(20);
        for _ in 0..ANSWERED_STEP * 4 {
            g.spell_ended(now, Spell::Answered);
            now += spell;
        }
        assert!(spell * ANSWERED_STEP * 4 < UNANSWERED_HOLD_OFF);
        g.spell_ended(now, Spell::Unanswered);
        assert_eq!(hold(&mut g, now), FIRST_HOLD_OFF * 2);
        // Fewer answered in a row than a step: the level stays.
        for _ in 0..ANSWERED_STEP - 1 {
            g.spell_ended(now, Spell::Answered);
        }
        g.spell_ended(now, Spell::Unanswered);
        assert_eq!(hold(&mut g, now), FIRST_HOLD_OFF * 4);
    }

    #[test]
    fn an_answer_after_the_window_counts_as_none() {
        // Polling went on past the window for a device deadline; the packet came after it.
        let t0 = Instant::now();
        let end = t0 + Duration::from_micros(50);
        assert_eq!(
            spell(looked(true, end + Duration::from_micros(30)), t0..end),
            Spell::Unanswered
        );
    }

    #[test]
    fn a_spinner_that_was_not_polled_through_its_window_gives_no_verdict() {
        // fio's thread drives the runtime: between its calls into the plugin the driver task
        // is not polled, and the spell's next look comes after the window with the answer
        // long there. Half the window unwatched is enough to say nothing.
        let t0 = Instant::now();
        let window = Duration::from_micros(50);
        let mut g = AnswerGate::default();
        let seen = Looked {
            input: true,
            at: t0 + window * 4,
            longest_gap: window * 4,
            network_peer: true,
        };
        let how = spell(seen, t0..t0 + window);
        assert_eq!(how, Spell::Away);
        g.spell_ended(seen.at, how);
        assert_eq!(g.misses, 0);
        assert!(g.allow(seen.at));
        let seen = Looked {
            longest_gap: window / 2,
            ..looked(false, t0 + window)
        };
        assert_eq!(spell(seen, t0..t0 + window), Spell::Away);
        // Short gaps (a yield to the runtime's other tasks) still leave a verdict.
        let seen = Looked {
            longest_gap: window / 3,
            ..looked(false, t0 + window)
        };
        assert_eq!(spell(seen, t0..t0 + window), Spell::Unanswered);
    }

    #[test]
    fn a_late_answer_from_a_peer_in_this_process_gives_no_verdict() {
        // Every packet went through memory to a task of this runtime: the spinner yields to
        // it, so a window that passed is not a peer wanting a core.
        let t0 = Instant::now();
        let end = t0 + Duration::from_micros(50);
        let seen = Looked {
            network_peer: false,
            ..looked(false, end)
        };
        assert_eq!(spell(seen, t0..end), Spell::InProcess);
        let mut g = AnswerGate::default();
        g.spell_ended(end, Spell::InProcess);
        assert_eq!(g.misses, 0);
        assert!(g.allow(end));
    }

    /// A spell the spinner watched throughout (looks 1 µs apart), its peer across the
    /// network.
    fn looked(input: bool, at: Instant) -> Looked {
        Looked {
            input,
            at,
            longest_gap: Duration::from_micros(1),
            network_peer: true,
        }
    }

    #[test]
    fn the_reading_is_this_threads() {
        let a = thread_preemptions().expect("getrusage(RUSAGE_THREAD)");
        assert_eq!(a.0, std::thread::current().id());
    }
}
