//! The real-engine harness itself, without engines: `engine.sh stop` must stop an engine however
//! busy the machine is. Runs with the unit tests (`scripts/test.sh`), not in the real-engine suite.

// Real processes in real time: waiting on them is what this test does.
#![allow(clippy::disallowed_methods)]

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use kvgate_real_engines::fleet::{group_alive, repo_root};

/// The process group of `pid`, from `/proc/PID/stat`.
fn pgid_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.split_whitespace().nth(2)?.parse().ok()
}

/// Times the stop is tried, each on a fresh stand-in: one try caught the old script two times in
/// three, since its scan failed only when a process vanished during it.
const TRIES: u32 = 6;

/// A stand-in engine (`sleep`, in a process group of its own, its pid in `dir/stand-in.pid` as
/// `engine.sh start` writes it) is stopped by `engine.sh stop` while other processes start and end
/// all the time, as they do while a suite winds down. `engine.sh` once read such a group as gone
/// (its `/proc` scan failed on a process that vanished mid-scan), sent no signal and deleted the pid
/// file: the engine ran on, and nothing was left to stop it.
#[test]
fn engine_sh_stops_a_group_while_processes_come_and_go() -> anyhow::Result<()> {
    let dir = repo_root().join(format!("target/real-engines/harness-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for attempt in 1..=TRIES {
        stop_a_stand_in(&dir).with_context(|| format!("try {attempt} of {TRIES}"))?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Starts a stand-in engine with its pid file in `dir` and stops it with `engine.sh stop` under churn.
fn stop_a_stand_in(dir: &Path) -> anyhow::Result<()> {
    let mut stand_in = Command::new("setsid").args(["sleep", "600"]).spawn().context("cannot run setsid sleep")?;
    let pid = stand_in.id();
    std::fs::write(dir.join("stand-in.pid"), format!("{pid}\n"))?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while pgid_of(pid) != Some(pid) {
        if Instant::now() > deadline {
            let _ = stand_in.kill();
            let _ = stand_in.wait();
            bail!("the stand-in never got a process group of its own");
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    // Churn: short-lived processes, one after another, on a thread of their own.
    let churning = Arc::new(AtomicBool::new(true));
    let churn = {
        let churning = churning.clone();
        std::thread::spawn(move || {
            while churning.load(Ordering::Relaxed) {
                let _ = Command::new("true").status();
            }
        })
    };
    let stopped = Command::new("bash")
        .arg(repo_root().join("scripts/real-engines/engine.sh"))
        .args(["stop", "stand-in", &dir.to_string_lossy()])
        .output();
    churning.store(false, Ordering::Relaxed);
    let _ = churn.join();
    let stopped = stopped.context("cannot run engine.sh")?;
    let alive = group_alive(pid);
    if alive {
        let _ = stand_in.kill();
    }
    let _ = stand_in.wait();
    ensure!(stopped.status.success(), "engine.sh stop failed: {}", String::from_utf8_lossy(&stopped.stderr));
    if alive {
        bail!("engine.sh stop left the stand-in engine's process group {pid} running");
    }
    ensure!(!dir.join("stand-in.pid").exists(), "engine.sh stop left the pid file");
    Ok(())
}
