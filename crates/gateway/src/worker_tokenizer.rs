//! The model's tokenizer taken from a gRPC worker (`GetTokenizer`) when none is configured, as
//! SMG's gRPC mode takes it: an SMG user's `--worker-urls grpc://...` line names no tokenizer.
//!
//! At start-up, before the gateway serves, each gRPC worker is asked in turn until one hands its
//! tokenizer over (the workers may still be starting: they are asked again every second until the
//! wait runs out). The archive is checked against the SHA-256 the worker gives, unpacked into the
//! cache (`$KVGATE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvgate`, else `~/.cache/kvgate`) under its
//! digest, and loaded from there like a configured model directory; an archive already unpacked
//! is not unpacked again.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{EngineKind, GatewayConfig, TokenizerSpec};
use crate::grpc_worker::{sha256_hex, GrpcRuntime, GrpcWorker};
use crate::GatewayError;

/// How long start-up waits for a gRPC worker to hand over its tokenizer.
pub const FETCH_WAIT: Duration = Duration::from_secs(180);
/// How long one download may take.
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(60);
/// The most files a tokenizer archive may hold (the servicers send about ten).
const MOST_FILES: usize = 64;
/// The most bytes its files may unpack to.
const MOST_BYTES: u64 = 1 << 30;

/// Where downloaded tokenizers are kept.
pub fn cache_root() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("KVGATE_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("kvgate")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("kvgate")))
        .unwrap_or_else(|| std::env::temp_dir().join("kvgate-cache"))
}

/// For a configuration without a tokenizer and with gRPC workers: takes the tokenizer of the first
/// gRPC worker that hands one over within `wait`, and configures it. Does nothing otherwise.
pub async fn resolve(config: &mut GatewayConfig, cache: &Path, wait: Duration) -> Result<(), GatewayError> {
    if !config.tokenizer_from_workers {
        return Ok(());
    }
    let workers: Vec<(String, GrpcWorker)> =
        config.workers.iter().filter_map(|w| Some((w.id(), w.grpc_worker(config.connect_timeout)?))).collect();
    if workers.is_empty() {
        return Ok(());
    }
    #[allow(clippy::disallowed_methods)] // start-up, before the gateway's clock exists
    let deadline = std::time::Instant::now() + wait;
    let mut last_errors = Vec::new();
    loop {
        last_errors.clear();
        for (id, worker) in &workers {
            match fetch(worker, cache).await {
                Ok(dir) => {
                    tracing::info!(worker = %id, dir = %dir.display(), "took the model's tokenizer from a gRPC worker (GetTokenizer)");
                    config.tokenizer = TokenizerSpec::Hf {
                        path: dir.display().to_string(),
                        chat_template: None,
                        content_format: None,
                        render: None,
                    };
                    // The workers that answered have shown their runtime: the rendering follows it.
                    let detected: Vec<EngineKind> = workers
                        .iter()
                        .filter_map(|(_, w)| w.known_runtime())
                        .map(|r| match r {
                            GrpcRuntime::Sglang => EngineKind::Sglang,
                            GrpcRuntime::Vllm => EngineKind::Vllm,
                        })
                        .collect();
                    config.tokenizer.resolve_render_detected(&config.workers, &detected)?;
                    return Ok(());
                }
                Err(e) => last_errors.push(format!("{id}: {e}")),
            }
        }
        #[allow(clippy::disallowed_methods)] // see above
        if std::time::Instant::now() >= deadline {
            return Err(GatewayError::Config(format!(
                "no tokenizer is configured, and no gRPC worker handed over its own within {} s ({}): give the \
                 model's tokenizer with --tokenizer DIR, or start the workers first",
                wait.as_secs(),
                last_errors.join("; ")
            )));
        }
        tracing::info!(errors = %last_errors.join("; "), "waiting for a gRPC worker to hand over its tokenizer");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Downloads `worker`'s tokenizer and unpacks it into `cache` (unless it is there already);
/// returns the directory holding its `tokenizer.json`.
pub async fn fetch(worker: &GrpcWorker, cache: &Path) -> Result<PathBuf, String> {
    let archive =
        worker.tokenizer_archive(DOWNLOAD_TIMEOUT).await.map_err(|s| format!("GetTokenizer: {}", s.message()))?;
    let digest = sha256_hex(&archive);
    let dir = cache.join("tokenizers").join(&digest);
    if dir.join(".complete").is_file() {
        return Ok(dir);
    }
    unpack(&archive, &dir)?;
    Ok(dir)
}

/// Unpacks a tokenizer archive into `dir` (written beside it first, then renamed, so a half-written
/// directory is never taken for a whole one). Only plain files at the top level are taken.
fn unpack(archive: &[u8], dir: &Path) -> Result<(), String> {
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(archive)).map_err(|e| format!("not a zip archive: {e}"))?;
    if zip.len() > MOST_FILES {
        return Err(format!("the archive holds {} files, more than a tokenizer's {MOST_FILES}", zip.len()));
    }
    let parent = dir.parent().ok_or("the cache directory has no parent")?;
    std::fs::create_dir_all(parent).map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    // Each unpacking its own: several gateways (or tests) sharing a cache may fetch at once.
    static UNPACKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = UNPACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let partial = parent.join(format!(".partial-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).map_err(|e| format!("cannot create {}: {e}", partial.display()))?;
    let mut total = 0u64;
    let mut has_tokenizer_json = false;
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(|e| format!("entry {i}: {e}"))?;
        if entry.is_dir() {
            continue;
        }
        let name = entry.name().map_err(|e| format!("entry {i}: {e}"))?.into_owned();
        if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
            return Err(format!("the archive holds {name:?}, not a plain file name"));
        }
        let mut bytes = Vec::new();
        let room = MOST_BYTES.saturating_sub(total);
        (&mut entry).take(room + 1).read_to_end(&mut bytes).map_err(|e| format!("{name}: {e}"))?;
        total += bytes.len() as u64;
        if total > MOST_BYTES {
            return Err(format!("the archive unpacks to more than {MOST_BYTES} bytes"));
        }
        has_tokenizer_json |= name == "tokenizer.json";
        std::fs::write(partial.join(&name), bytes).map_err(|e| format!("cannot write {name}: {e}"))?;
    }
    if !has_tokenizer_json {
        let _ = std::fs::remove_dir_all(&partial);
        return Err("the worker's tokenizer has no tokenizer.json (only SentencePiece or tiktoken files), which \
                    kvgate cannot load: give it with --tokenizer"
            .into());
    }
    std::fs::write(partial.join(".complete"), b"").map_err(|e| format!("cannot write the marker: {e}"))?;
    let moved = std::fs::rename(&partial, dir).or_else(|first| {
        if dir.join(".complete").is_file() {
            return Ok(()); // another unpacking of the same archive finished first
        }
        // A directory left half-written by a process that died before this scheme: replace it.
        let _ = std::fs::remove_dir_all(dir);
        std::fs::rename(&partial, dir).or_else(|_| if dir.join(".complete").is_file() { Ok(()) } else { Err(first) })
    });
    let _ = std::fs::remove_dir_all(&partial);
    moved.map_err(|e| format!("cannot move the tokenizer into {}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn archive(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = std::io::Cursor::new(Vec::new());
        {
            let mut zip = zip::ZipWriter::new(&mut out);
            for (name, bytes) in files {
                zip.start_file(*name, zip::write::SimpleFileOptions::default()).unwrap();
                zip.write_all(bytes).unwrap();
            }
            zip.finish().unwrap();
        }
        out.into_inner()
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvgate-unpack-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_bundle_is_unpacked_whole_with_its_marker() {
        let root = scratch("whole");
        let dir = root.join("abc");
        unpack(&archive(&[("tokenizer.json", b"{}"), ("tokenizer_config.json", b"{\"x\": 1}")]), &dir).unwrap();
        assert_eq!(std::fs::read(dir.join("tokenizer_config.json")).unwrap(), b"{\"x\": 1}");
        assert!(dir.join(".complete").is_file());
        assert!(!root.join(format!(".partial-{}", std::process::id())).exists());
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn paths_and_bundles_without_tokenizer_json_are_refused() {
        let root = scratch("refused");
        let err = unpack(&archive(&[("../evil.json", b"{}")]), &root.join("a")).unwrap_err();
        assert!(err.contains("not a plain file name"), "{err}");
        let err = unpack(&archive(&[("tokenizer.model", b"spm")]), &root.join("b")).unwrap_err();
        assert!(err.contains("no tokenizer.json"), "{err}");
        assert!(!root.join("b").exists());
        let err = unpack(b"not a zip", &root.join("c")).unwrap_err();
        assert!(err.contains("not a zip archive"), "{err}");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn gateways_unpacking_the_same_archive_at_once_all_get_it_whole() {
        let dir = scratch("racing").join("tokenizers").join("same");
        let bundle = archive(&[("tokenizer.json", b"{\"x\": 1}"), ("tokenizer_config.json", b"{}")]);
        let racers: Vec<_> = (0..8)
            .map(|_| {
                let (dir, bundle) = (dir.clone(), bundle.clone());
                std::thread::spawn(move || unpack(&bundle, &dir))
            })
            .collect();
        for r in racers {
            assert_eq!(r.join().unwrap(), Ok(()));
        }
        assert_eq!(std::fs::read(dir.join("tokenizer.json")).unwrap(), b"{\"x\": 1}");
        assert!(dir.join(".complete").is_file());
        let left: Vec<_> = std::fs::read_dir(dir.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("same")], "no partial directory left behind");
    }
}
