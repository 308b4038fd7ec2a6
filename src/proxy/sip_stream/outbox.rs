//! The write queue toward one client connection of a SIP stream vserver, bounded in bytes.
//!
//! A client that sends faster than it reads its answers (a trunk bursting thousands of
//! INVITEs) is slowed down, not cut off: above [`PAUSE_ABOVE`] queued bytes its reader stops
//! reading its requests (they wait in its socket, and TCP's window slows the client) until the
//! writer has brought the queue under [`RESUME_BELOW`]. Only a client whose queue would pass
//! [`QUEUE_LIMIT`] (answers to requests already forwarded keep coming while reading is paused)
//! or whose writes make no progress for `CLIENT_SEND_TIMEOUT` (the shell's) is disconnected.
//!
//! No IO: a queue, a byte count and a wake-up.

use super::Outgoing;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::{Notify, mpsc};

/// What a queued message is counted for besides its own bytes (its slot and handle), so that
/// a flood of tiny messages (pongs) is bounded too.
pub(crate) const MESSAGE_COST: usize = 64;
/// Queued bytes above which the client's requests are no longer read.
pub(crate) const PAUSE_ABOVE: usize = 1 << 20;
/// Queued bytes under which a paused reader reads again.
pub(crate) const RESUME_BELOW: usize = 256 << 10;
/// Queued bytes a message may not take the queue past: the client is disconnected.
pub(crate) const QUEUE_LIMIT: usize = 16 << 20;

/// The bytes a message counts for in the queue.
pub(crate) fn cost(bytes: &[u8]) -> usize {
    bytes.len() + MESSAGE_COST
}

/// The sending side, held in the vserver's client table: dropping it (the client forgotten)
/// ends the writer once the queue is empty.
#[derive(Debug)]
pub(crate) struct Outbox {
    tx: mpsc::UnboundedSender<Outgoing>,
    level: Arc<Level>,
}

/// How full the queue is, shared by the outbox, the writer (which lowers it) and the reader
/// (which waits on it).
#[derive(Debug, Default)]
pub(crate) struct Level {
    queued: AtomicUsize,
    drained: Notify,
}

/// What [`Outbox::push`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Push {
    Queued,
    /// Over [`QUEUE_LIMIT`]: not queued, the client is to be disconnected.
    Full,
    /// The writer is gone.
    Closed,
}

impl Outbox {
    pub(crate) fn new() -> (Outbox, mpsc::UnboundedReceiver<Outgoing>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let level = Arc::new(Level::default());
        (Outbox { tx, level }, rx)
    }

    pub(crate) fn level(&self) -> Arc<Level> {
        Arc::clone(&self.level)
    }

    /// Queue `msg` unless that would take the queue past [`QUEUE_LIMIT`].
    pub(crate) fn push(&self, msg: Outgoing) -> Push {
        let cost = cost(&msg);
        let before = self.level.queued.fetch_add(cost, Ordering::Relaxed);
        if before + cost > QUEUE_LIMIT {
            self.level.queued.fetch_sub(cost, Ordering::Relaxed);
            return Push::Full;
        }
        match self.tx.send(msg) {
            Ok(()) => Push::Queued,
            Err(_) => {
                self.level.queued.fetch_sub(cost, Ordering::Relaxed);
                Push::Closed
            }
        }
    }
}

impl Level {
    /// Bytes counted in the queue now.
    pub(crate) fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// The writer wrote messages that counted `cost`: a paused reader is woken once the queue
    /// is under [`RESUME_BELOW`].
    pub(crate) fn written(&self, cost: usize) {
        let before = self.queued.fetch_sub(cost, Ordering::Relaxed);
        let after = before.saturating_sub(cost);
        if before > RESUME_BELOW && after <= RESUME_BELOW {
            // Stored when the reader is not waiting yet: its next wait returns at once.
            self.drained.notify_one();
        }
    }

    /// Whether the reader should stop reading the client's requests.
    pub(crate) fn should_pause(&self) -> bool {
        self.queued() > PAUSE_ABOVE
    }

    /// Wait until the queue is under [`RESUME_BELOW`].
    pub(crate) async fn drained(&self) {
        while self.queued() > RESUME_BELOW {
            self.drained.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::time::Duration;

    fn msg(len: usize) -> Outgoing {
        Bytes::from(vec![b'x'; len]).into()
    }

    #[test]
    fn the_queue_counts_bytes_and_refuses_what_would_pass_the_limit() {
        let (out, mut rx) = Outbox::new();
        let level = out.level();
        assert_eq!(out.push(msg(100)), Push::Queued);
        assert_eq!(level.queued(), 100 + MESSAGE_COST);
        // Fill to just under the limit, then one byte more is refused and not counted.
        let room = QUEUE_LIMIT - level.queued() - MESSAGE_COST;
        assert_eq!(out.push(msg(room)), Push::Queued);
        assert_eq!(level.queued(), QUEUE_LIMIT);
        assert_eq!(out.push(msg(0)), Push::Full);
        assert_eq!(level.queued(), QUEUE_LIMIT);
        // What the writer takes out and writes is no longer counted.
        let first = rx.try_recv().expect("first");
        level.written(cost(&first));
        assert_eq!(out.push(msg(0)), Push::Queued);
        drop(rx);
        let before = level.queued();
        assert_eq!(out.push(msg(10)), Push::Closed);
        assert_eq!(level.queued(), before);
    }

    #[test]
    fn tiny_messages_count_for_their_slot() {
        let (out, _rx) = Outbox::new();
        let n = QUEUE_LIMIT / (2 + MESSAGE_COST);
        for _ in 0..n {
            assert_eq!(out.push(Bytes::from_static(b"\r\n").into()), Push::Queued);
        }
        assert_eq!(out.push(Bytes::from_static(b"\r\n").into()), Push::Full);
    }

    #[test]
    fn reading_pauses_above_the_high_mark_and_resumes_under_the_low_one() {
        let (out, mut rx) = Outbox::new();
        let level = out.level();
        let size = 4096;
        let mut queued = 0;
        while !level.should_pause() {
            out.push(msg(size));
            queued += 1;
        }
        assert!(level.queued() > PAUSE_ABOVE);
        assert!(level.queued() <= PAUSE_ABOVE + size + MESSAGE_COST);
        // Between the marks: no longer paused, but a waiting reader would not resume yet.
        while level.queued() > PAUSE_ABOVE {
            let m = rx.try_recv().expect("queued");
            level.written(cost(&m));
            queued -= 1;
        }
        assert!(!level.should_pause());
        assert!(level.queued() > RESUME_BELOW);
        assert!(queued > 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_reader_wakes_when_the_writer_drains_the_queue() {
        let (out, mut rx) = Outbox::new();
        let level = out.level();
        while !level.should_pause() {
            out.push(msg(8192));
        }
        let waiter = tokio::spawn({
            let level = Arc::clone(&level);
            async move { level.drained().await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            !waiter.is_finished(),
            "the queue is still above the low mark"
        );
        // The writer drains to exactly the low mark: the reader wakes.
        while level.queued() > RESUME_BELOW {
            let m = rx.try_recv().expect("queued");
            level.written(cost(&m));
        }
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("the reader woke")
            .expect("task");
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_up_left_from_an_earlier_drain_does_not_resume_a_full_queue() {
        let (out, mut rx) = Outbox::new();
        let level = out.level();
        let fill = |out: &Outbox| {
            while !out.level.should_pause() {
                out.push(msg(8192));
            }
        };
        fill(&out);
        // Drained with no reader waiting: the wake-up is stored.
        while let Ok(m) = rx.try_recv() {
            level.written(cost(&m));
        }
        fill(&out);
        let early = tokio::time::timeout(Duration::from_secs(1), level.drained()).await;
        assert!(early.is_err(), "the reader resumed on a full queue");
    }
}
