//! The runtime's shutdown: one signal raised once, awaited by async tasks and seen by worker
//! threads, and a bounded wait for the tasks that must finish before the runtime goes. IO.
//!
//! - Async tasks await [`Signal::recv`] (a `watch` channel: no polling, no timer).
//! - Threads that block in a system call keep a flag ([`Shutdown::flag`], one relaxed load per
//!   receive batch) and register a wake-up ([`Shutdown::on_raise`]) that ends the blocking call
//!   at once (a mio `Waker`, or `shutdown(SHUT_RD)` on a blocking socket).
//! - Threads that sleep between periodic jobs sleep in [`Shutdown::sleep`], which the raise
//!   ends early.
//! - A task that must finish before [`Shutdown::wait`] returns holds a [`TaskGuard`] of its
//!   [`TaskGroup`] (mini-redis's `shutdown_complete` sender, with a name so that what did not
//!   finish can be reported). A guard costs two atomic operations, never a lock or a system
//!   call, so connection handlers can hold one.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// A wake-up for a thread blocked in a system call, run once when shutdown is raised.
type Wake = Box<dyn FnOnce() + Send>;

/// The owner's side: raise once, then wait for the guarded tasks.
pub(crate) struct Shutdown {
    signal: watch::Sender<bool>,
    flag: Arc<AtomicBool>,
    inner: Arc<Inner>,
}

/// What the guards and sleeping threads share with the owner.
#[derive(Default)]
struct Inner {
    /// Set with the signal; guards notify `changed` only from then on.
    raised: AtomicBool,
    state: Mutex<State>,
    /// Notified on the raise and whenever a group empties after it.
    changed: Condvar,
}

#[derive(Default)]
struct State {
    raised: bool,
    groups: Vec<Arc<Group>>,
    wakes: Vec<Wake>,
}

struct Group {
    name: String,
    live: AtomicUsize,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shutdown")
            .field("raised", &self.is_raised())
            .finish_non_exhaustive()
    }
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub(crate) fn new() -> Shutdown {
        Shutdown {
            signal: watch::Sender::new(false),
            flag: Arc::new(AtomicBool::new(false)),
            inner: Arc::new(Inner::default()),
        }
    }

    /// The signal async tasks await.
    pub(crate) fn signal(&self) -> Signal {
        Signal {
            rx: self.signal.subscribe(),
        }
    }

    /// The flag a worker thread looks at between two blocking calls; pair it with
    /// [`Shutdown::on_raise`] so that the blocking call ends when it is set.
    pub(crate) fn flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.flag)
    }

    /// Run `wake` when shutdown is raised (at once if it already is): it ends a system call
    /// a worker thread blocks in, so the thread sees [`Shutdown::flag`] without a timer.
    pub(crate) fn on_raise(&self, wake: impl FnOnce() + Send + 'static) {
        let mut s = self.inner.lock();
        if s.raised {
            drop(s);
            wake();
        } else {
            s.wakes.push(Box::new(wake));
        }
    }

    /// A named group of tasks [`Shutdown::wait`] waits for.
    pub(crate) fn group(&self, name: impl Into<String>) -> TaskGroup {
        let g = Arc::new(Group {
            name: name.into(),
            live: AtomicUsize::new(0),
            inner: Arc::clone(&self.inner),
        });
        let mut s = self.inner.lock();
        // Groups of vservers that were rebuilt away, with nothing left in them, go.
        s.groups
            .retain(|g| Arc::strong_count(g) > 1 || g.live.load(Ordering::Acquire) > 0);
        s.groups.push(Arc::clone(&g));
        TaskGroup(g)
    }

    /// Raise the signal: async tasks' [`Signal::recv`] resolve, the flag is set, blocked
    /// threads are woken and sleeping ones return. Idempotent.
    pub(crate) fn raise(&self) {
        self.flag.store(true, Ordering::Release);
        self.inner.raised.store(true, Ordering::Release);
        self.signal.send_replace(true);
        let wakes = {
            let mut s = self.inner.lock();
            s.raised = true;
            std::mem::take(&mut s.wakes)
        };
        self.inner.changed.notify_all();
        for wake in wakes {
            wake();
        }
    }

    pub(crate) fn is_raised(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// A handle for a thread that runs a periodic job (no async runtime to await the signal
    /// on): [`Sleeper::sleep`] sleeps, or less if shutdown is raised meanwhile.
    pub(crate) fn sleeper(&self) -> Sleeper {
        Sleeper(Arc::clone(&self.inner))
    }

    /// Block (not async: call from outside the tasks' runtime) until every guarded task has
    /// finished or `timeout` passes; the groups still running then, with their task counts.
    pub(crate) fn wait(&self, timeout: Duration) -> Vec<(String, usize)> {
        let deadline = Instant::now() + timeout;
        let mut s = self.inner.lock();
        loop {
            let left: Vec<(String, usize)> = s
                .groups
                .iter()
                .map(|g| (g.name.clone(), g.live.load(Ordering::Acquire)))
                .filter(|(_, n)| *n > 0)
                .collect();
            let now = Instant::now();
            if left.is_empty() || now >= deadline {
                return left;
            }
            s = match self.inner.changed.wait_timeout(s, deadline - now) {
                Ok((s, _)) => s,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }
}

fn sleep(inner: &Inner, d: Duration) -> bool {
    let s = inner.lock();
    let (s, _) = inner
        .changed
        .wait_timeout_while(s, d, |s| !s.raised)
        .unwrap_or_else(|e| e.into_inner());
    s.raised
}

/// [`Shutdown::sleep`] for a thread that does not own the [`Shutdown`].
#[derive(Clone)]
pub(crate) struct Sleeper(Arc<Inner>);

impl Sleeper {
    /// Sleep `d`, or less if shutdown is raised meanwhile: true when it is raised.
    pub(crate) fn sleep(&self, d: Duration) -> bool {
        sleep(&self.0, d)
    }
}

impl std::fmt::Debug for Sleeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sleeper").finish_non_exhaustive()
    }
}

/// The shutdown signal as an async task sees it.
#[derive(Clone, Debug)]
pub struct Signal {
    rx: watch::Receiver<bool>,
}

impl Signal {
    /// Resolves once shutdown is raised (at once if it already is, or if the owner is gone).
    pub async fn recv(&mut self) {
        let _ = self.rx.wait_for(|raised| *raised).await;
    }
}

/// A named set of tasks the shutdown waits for.
#[derive(Clone)]
pub struct TaskGroup(Arc<Group>);

impl std::fmt::Debug for TaskGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskGroup")
            .field("name", &self.0.name)
            .field("live", &self.0.live.load(Ordering::Relaxed))
            .finish()
    }
}

impl TaskGroup {
    /// A guard for one task: move it into the task, so that it drops when the task ends,
    /// however it ends (returned, aborted, or dropped with its runtime).
    pub fn guard(&self) -> TaskGuard {
        self.0.live.fetch_add(1, Ordering::AcqRel);
        TaskGuard(Arc::clone(&self.0))
    }
}

/// Held by a running task of a [`TaskGroup`].
pub struct TaskGuard(Arc<Group>);

impl std::fmt::Debug for TaskGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("TaskGuard").field(&self.0.name).finish()
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        let was = self.0.live.fetch_sub(1, Ordering::AcqRel);
        // Before the raise nobody waits: no lock on a connection's way out. After it, the
        // lock orders this decrement with the waiter's look at the counts.
        if was == 1 && self.0.inner.raised.load(Ordering::Acquire) {
            drop(self.0.inner.lock());
            self.0.inner.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_returns_once_guards_drop_and_names_the_rest() {
        let s = Shutdown::new();
        let a = s.group("a");
        let b = s.group("b");
        let ga = a.guard();
        let _gb = b.guard();
        s.raise();
        let t = std::thread::spawn(move || drop(ga));
        let left = s.wait(Duration::from_millis(200));
        t.join().expect("thread");
        assert_eq!(left, vec![("b".to_owned(), 1)]);
    }

    #[test]
    fn wait_without_tasks_is_immediate() {
        let s = Shutdown::new();
        let _g = s.group("idle");
        s.raise();
        assert!(s.wait(Duration::from_secs(10)).is_empty());
    }

    #[test]
    fn sleep_ends_on_raise_and_wakes_run_once() {
        let s = Arc::new(Shutdown::new());
        let woke = Arc::new(AtomicUsize::new(0));
        let w = Arc::clone(&woke);
        s.on_raise(move || {
            w.fetch_add(1, Ordering::Relaxed);
        });
        let sleeper = s.sleeper();
        let t = std::thread::spawn(move || sleeper.sleep(Duration::from_secs(60)));
        s.raise();
        s.raise();
        assert!(t.join().expect("thread"));
        assert_eq!(woke.load(Ordering::Relaxed), 1);
        assert!(s.is_raised());
        let late = Arc::clone(&woke);
        s.on_raise(move || {
            late.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(woke.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn signal_resolves_on_raise() {
        let s = Shutdown::new();
        let mut sig = s.signal();
        let task = tokio::spawn(async move { sig.recv().await });
        s.raise();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("resolved")
            .expect("task");
        // Also at once for a signal taken after the raise.
        s.signal().recv().await;
    }
}
