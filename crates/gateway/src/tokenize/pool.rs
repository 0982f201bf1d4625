//! The threads that tokenize large prompts, apart from the async workers that serve connections.
//!
//! A 32 KB prompt takes a real BPE tokenizer about 12 ms. On tokio's blocking pool that work ran at
//! the same priority as the async workers, so on 2 cores a small request behind it waited for the
//! scheduler's time slice: its p99 rose by 3.3 ms while long prompts were tokenized whole (issue
//! 33's `scripts/small-beside-long.sh`). These threads run at a lower priority (a higher nice
//! value), so whenever a connection has work the kernel gives it the core first, and the
//! tokenizing takes whatever time is left: the same work, done at the same speed on an otherwise
//! idle machine. A job whose caller has gone by the time a thread takes it is skipped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use thiserror::Error;

/// How much lower than the process's own priority tokenizing runs (Linux nice steps): at +10 a
/// busy async worker gets about nine tenths of a contended core (CFS weights 1024 against 110),
/// while an idle machine still gives the tokenizer all of it.
pub const TOKENIZE_NICE: i32 = 10;

/// Why a job did not run to its end.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PoolError {
    /// The job panicked (the tokenizer's bug); the panic was logged and the thread lives on.
    #[error("the tokenizing job panicked")]
    Panicked,
}

/// A fixed set of low-priority threads for tokenizing, FIFO.
pub struct TokenizePool {
    pool: rayon::ThreadPool,
    /// Jobs handed over and not yet finished, queued or running.
    pending: Arc<AtomicUsize>,
}

impl TokenizePool {
    /// A pool of `threads` threads (at least one), each lowered by `nice` steps of priority where
    /// the platform allows it (Linux; elsewhere, or if the kernel refuses, they keep the process's
    /// priority and a warning says so).
    pub fn new(threads: usize, nice: i32) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvgate-tokenize-{i}"))
            .start_handler(move |_| lower_priority(nice))
            .panic_handler(|_| tracing::error!("a tokenizing job panicked; its request gets a 500"))
            .build()
            .map_err(std::io::Error::other)?;
        Ok(TokenizePool { pool, pending: Arc::new(AtomicUsize::new(0)) })
    }

    /// One fewer thread than the cores (at least one), so the async workers always have a core.
    pub fn for_this_machine() -> std::io::Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new(cores.saturating_sub(1), TOKENIZE_NICE)
    }

    /// How many threads it has.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `job` on a pool thread once the jobs handed over before it have started, and returns
    /// its result. Dropping the returned future before a thread takes the job skips it.
    pub async fn run<R, F>(&self, job: F) -> Result<R, PoolError>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let pending = Pending::count(&self.pending);
        self.pool.spawn_fifo(move || {
            let result = (!tx.is_closed()).then(job);
            // No longer pending before the caller can see the result, so a caller that reads the
            // count after its job never finds its own job still counted.
            drop(pending);
            if let Some(result) = result {
                let _ = tx.send(result);
            }
        });
        rx.await.map_err(|_| PoolError::Panicked)
    }

    /// Runs `job` in the background only if a thread is free now (nothing queued): for work that
    /// may as well not be done when the pool is busy. Says whether it was handed over.
    pub fn run_if_idle<F>(&self, job: F) -> bool
    where
        F: FnOnce() + Send + 'static,
    {
        if self.pending.load(Ordering::Acquire) >= self.threads() {
            return false;
        }
        let pending = Pending::count(&self.pending);
        self.pool.spawn_fifo(move || {
            let _pending = pending;
            job();
        });
        true
    }
}

/// One job counted as pending until it is dropped: run, skipped or unwound by a panic.
struct Pending(Arc<AtomicUsize>);

impl Pending {
    fn count(pending: &Arc<AtomicUsize>) -> Self {
        pending.fetch_add(1, Ordering::AcqRel);
        Pending(pending.clone())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Lowers the calling thread's priority by `nice` steps. Linux keeps a nice value per thread (the
/// thread's id names it to `setpriority`), which is what lets these threads yield to the rest.
#[cfg(target_os = "linux")]
fn lower_priority(nice: i32) {
    let tid = rustix::thread::gettid();
    let current = rustix::process::getpriority_process(Some(tid)).unwrap_or(0);
    if let Err(e) = rustix::process::setpriority_process(Some(tid), current.saturating_add(nice)) {
        tracing::warn!(error = %e, "tokenizing threads keep the gateway's priority: small requests may wait behind long prompts");
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority(_nice: i32) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_job_runs_on_a_pool_thread_and_returns_its_result() {
        let pool = TokenizePool::new(1, 0).unwrap();
        let name = pool.run(|| std::thread::current().name().map(str::to_owned)).await.unwrap();
        assert_eq!(name.as_deref(), Some("kvgate-tokenize-0"));
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn pool_threads_run_at_a_lower_priority_than_the_caller() {
        let caller = rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap();
        let pool = TokenizePool::new(1, 5).unwrap();
        let inside = pool.run(|| rustix::process::getpriority_process(Some(rustix::thread::gettid()))).await;
        assert_eq!(inside.unwrap().unwrap(), (caller + 5).min(19));
    }

    #[tokio::test]
    async fn a_panicking_job_is_an_error_and_the_pool_goes_on() {
        let pool = TokenizePool::new(1, 0).unwrap();
        assert_eq!(pool.run(|| -> u32 { panic!("tokenizer bug") }).await, Err(PoolError::Panicked));
        assert_eq!(pool.run(|| 7).await, Ok(7));
        assert_eq!(pool.pending.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn a_job_whose_caller_left_before_it_started_is_skipped() {
        use futures_util::poll;
        let pool = TokenizePool::new(1, 0).unwrap();
        let (release, hold) = std::sync::mpsc::channel::<()>();
        // Occupies the only thread until released.
        let mut busy = Box::pin(pool.run(move || hold.recv().ok()));
        assert!(poll!(&mut busy).is_pending());
        let ran = Arc::new(AtomicUsize::new(0));
        let counted = ran.clone();
        // Handed over (the first poll), queued behind the busy job, then its caller goes away.
        let mut abandoned = Box::pin(pool.run(move || counted.fetch_add(1, Ordering::AcqRel)));
        assert!(poll!(&mut abandoned).is_pending());
        drop(abandoned);
        release.send(()).unwrap();
        busy.await.unwrap();
        // FIFO: this one is taken after the abandoned one.
        assert_eq!(pool.run(|| ()).await, Ok(()));
        assert_eq!(ran.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn background_work_is_handed_over_only_while_a_thread_is_free() {
        let pool = TokenizePool::new(1, 0).unwrap();
        let (release, hold) = std::sync::mpsc::channel::<()>();
        assert!(pool.run_if_idle(move || {
            let _ = hold.recv();
        }));
        assert!(!pool.run_if_idle(|| ()));
        release.send(()).unwrap();
        // Queued after the released job, so it finishes after it.
        pool.run(|| ()).await.unwrap();
        while pool.pending.load(Ordering::Acquire) > 0 {
            tokio::task::yield_now().await;
        }
        assert!(pool.run_if_idle(|| ()));
    }
}
