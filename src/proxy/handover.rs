//! The hand-over of a rebuilt SIP core: once a reload has stored the new core where the
//! workers load it from, it waits until every worker that may still use the old one has
//! finished the message it was handling, as the workers tell it. IO only in the waiting
//! (the reload's thread yields and sleeps); no lock, allocation or system call per message.
//!
//! Each worker (a sip-udp receive thread, a SIP stream connection's task, a link's task, a
//! sweeper) owns a [`Reader`] registered with its vserver's [`Readers`], and marks each
//! message it handles with the core by [`Reader::enter`]: its slot is odd from before it
//! loads the core until the message is done, even between messages. A worker blocked in a
//! receive between messages holds no core and never delays a reload. [`Readers::wait`] looks
//! at every slot once, after the new core is stored: a worker found between messages loads
//! the new core for its next one; a worker found in a message is waited for until its slot
//! moves on, that is until it has finished that message (the next one began after the swap,
//! with the new core). There is no time limit: a reload that went on while a worker still
//! used the old core would lose what that worker did to the old dialog table.
//!
//! Why a fence on each side: a worker stores its mark then loads the core, the reload stores
//! the core then loads the marks. Without a full fence between the store and the load on both
//! sides, each could read the other's old value (a store may wait in its CPU's store buffer
//! past a later load), and the reload would pass a worker that loaded the old core. With the
//! fences, either the reload sees the mark or the worker loads the new core.

use crate::sync::lock;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The workers of one vserver that load its core per message.
#[derive(Debug, Default)]
pub(crate) struct Readers {
    slots: Mutex<Vec<Weak<AtomicU64>>>,
}

/// How long a hand-over waits before it says so in the log (it goes on waiting): a message
/// takes microseconds, so a worker this long in one is stalled (a stopped process, a
/// debugger).
const STALL_NOTICE: Duration = Duration::from_secs(1);

impl Readers {
    /// A new worker's reader. Not on a message's path: a worker registers once, when it
    /// starts (a thread, a connection's task).
    pub(crate) fn register(&self) -> Reader {
        let slot = Arc::new(AtomicU64::new(0));
        let mut slots = lock(&self.slots);
        slots.retain(|s| s.strong_count() > 0);
        slots.push(Arc::downgrade(&slot));
        Reader { slot }
    }

    /// Called once the new core is stored where the workers load it from: returns when no
    /// worker still handles a message it may have begun with the old core. Workers between
    /// messages, and workers that began their message after the store, are not waited for.
    pub(crate) fn wait(&self) {
        // Pairs with the fence of `Reader::enter` (see the module doc).
        fence(Ordering::SeqCst);
        let busy: Vec<(Arc<AtomicU64>, u64)> = lock(&self.slots)
            .iter()
            .filter_map(Weak::upgrade)
            .filter_map(|s| {
                let at = s.load(Ordering::Relaxed);
                (at & 1 == 1).then_some((s, at))
            })
            .collect();
        let start = Instant::now();
        let mut told = false;
        for (slot, at) in busy {
            let mut spins = 0u32;
            // Acquire: what the worker did with the old core happens before what follows.
            while slot.load(Ordering::Acquire) == at {
                if spins < 64 {
                    spins += 1;
                    std::thread::yield_now();
                    continue;
                }
                if !told && start.elapsed() >= STALL_NOTICE {
                    told = true;
                    tracing::warn!(
                        "reload: a worker has been handling one message for over {STALL_NOTICE:?}; waiting for it to finish"
                    );
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// How many registered readers are in a message now (for tests).
    #[cfg(test)]
    pub(crate) fn busy(&self) -> usize {
        lock(&self.slots)
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|s| s.load(Ordering::Acquire) & 1 == 1)
            .count()
    }
}

/// One worker's slot in its vserver's [`Readers`]. Owned by that worker alone: only it
/// enters messages with it (the slot's odd and even values count its messages).
#[derive(Debug)]
pub(crate) struct Reader {
    slot: Arc<AtomicU64>,
}

impl Reader {
    /// The slot this reader marks, for the watchdog ([`crate::liveness`]).
    pub(crate) fn mark(&self) -> Weak<AtomicU64> {
        Arc::downgrade(&self.slot)
    }

    /// Mark the start of a message: call before loading the core, and keep the returned
    /// guard until the message is done with it (its drop marks the end). A message entered
    /// while one is under way (a nested call) is part of that one.
    #[inline]
    pub(crate) fn enter(&self) -> InMessage<'_> {
        let at = self.slot.load(Ordering::Relaxed);
        if at & 1 == 1 {
            return InMessage { done: None };
        }
        self.slot.store(at + 1, Ordering::Relaxed);
        // The mark before the load of the core (see the module doc).
        fence(Ordering::SeqCst);
        InMessage {
            done: Some((&self.slot, at + 2)),
        }
    }
}

/// A worker in the middle of a message ([`Reader::enter`]); dropped when it is done.
#[derive(Debug)]
#[must_use = "the message ends when the guard is dropped"]
pub(crate) struct InMessage<'a> {
    done: Option<(&'a AtomicU64, u64)>,
}

impl Drop for InMessage<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Some((slot, next)) = self.done {
            // Release: pairs with the Acquire of `Readers::wait`.
            slot.store(next, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arc_swap::ArcSwap;
    use std::sync::mpsc;

    /// A worker that loaded the old value and is held in the middle of its message: the
    /// hand-over waits for it however long it is held, and returns as soon as it finishes.
    #[test]
    fn the_hand_over_waits_for_a_worker_in_a_message_and_no_longer() {
        let readers = Arc::new(Readers::default());
        let cell = Arc::new(ArcSwap::from_pointee(1u32));
        let (loaded_tx, loaded) = mpsc::channel();
        let (go, go_rx) = mpsc::channel::<()>();
        let worker = {
            let (reader, cell) = (readers.register(), Arc::clone(&cell));
            std::thread::spawn(move || {
                let _in = reader.enter();
                let seen = **cell.load();
                loaded_tx.send(seen).expect("loaded");
                go_rx.recv().expect("go");
            })
        };
        assert_eq!(loaded.recv().expect("the worker loaded"), 1);
        cell.store(Arc::new(2));
        let (done_tx, done) = mpsc::channel();
        let switch = {
            let readers = Arc::clone(&readers);
            std::thread::spawn(move || {
                readers.wait();
                done_tx.send(Instant::now()).expect("done");
            })
        };
        // Longer than the old hand-over's time limit would be too slow a test; the wait has
        // no limit at all, and this shows it does not pass the worker early.
        assert!(
            done.recv_timeout(Duration::from_millis(300)).is_err(),
            "the hand-over went on while a worker was in the middle of a message"
        );
        let released = Instant::now();
        go.send(()).expect("go");
        let finished = done.recv().expect("the hand-over returned");
        assert!(
            finished.duration_since(released) < Duration::from_secs(1),
            "the hand-over did not return once the worker finished"
        );
        worker.join().expect("worker");
        switch.join().expect("switch");
        assert_eq!(readers.busy(), 0);
    }

    /// Workers between messages (blocked in a receive, holding nothing) do not delay the
    /// hand-over, however long they stay there.
    #[test]
    fn idle_workers_never_delay_the_hand_over() {
        let readers = Arc::new(Readers::default());
        let (mut wakes, mut idle) = (Vec::new(), Vec::new());
        for _ in 0..4 {
            let (wake, sleep) = mpsc::channel::<()>();
            let reader = readers.register();
            idle.push(std::thread::spawn(move || {
                // Between messages until woken, then one message.
                let _ = sleep.recv();
                drop(reader.enter());
            }));
            wakes.push(wake);
        }
        // One that has handled messages and is between two.
        let mine = readers.register();
        drop(mine.enter());
        drop(mine.enter());
        let (done_tx, done) = mpsc::channel();
        let switch = {
            let readers = Arc::clone(&readers);
            std::thread::spawn(move || {
                readers.wait();
                done_tx.send(()).expect("done");
            })
        };
        done.recv_timeout(Duration::from_secs(5))
            .expect("the hand-over returned while every worker was idle");
        switch.join().expect("switch");
        drop(wakes);
        for t in idle {
            t.join().expect("idle worker");
        }
    }

    /// Under a stream of messages, no worker ever handles one with a value older than the
    /// last hand-over completed: the mark and the swap are each fenced (see the module doc).
    #[test]
    fn a_completed_hand_over_leaves_no_worker_on_the_old_value() {
        use std::sync::atomic::AtomicBool;
        const SWAPS: u64 = 50;
        let readers = Arc::new(Readers::default());
        let cell = Arc::new(ArcSwap::from_pointee(0u64));
        // The value every message must see at least: raised only after a hand-over.
        let floor = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        // The swaps begin once both workers are handling messages.
        let running = Arc::new(std::sync::Barrier::new(3));
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let reader = readers.register();
                let running = Arc::clone(&running);
                let (cell, floor, stop) =
                    (Arc::clone(&cell), Arc::clone(&floor), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut stale = 0u64;
                    running.wait();
                    while !stop.load(Ordering::Relaxed) {
                        let _in = reader.enter();
                        let seen = **cell.load();
                        // The message's work: a hand-over that did not wait for it would
                        // raise the floor meanwhile.
                        for _ in 0..200 {
                            std::hint::spin_loop();
                        }
                        if seen < floor.load(Ordering::SeqCst) {
                            stale += 1;
                        }
                    }
                    stale
                })
            })
            .collect();
        running.wait();
        for v in 1..=SWAPS {
            cell.store(Arc::new(v));
            readers.wait();
            floor.store(v, Ordering::SeqCst);
        }
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            assert_eq!(
                w.join().expect("worker"),
                0,
                "a message used a handed-over value"
            );
        }
    }
}
