//! Discovery for bare-metal fleets (Slurm, not Kubernetes): a workers file that kvgate watches.
//!
//! The file lists engines as the configuration's `[[workers]]` do, in TOML (`[[workers]]` tables) or
//! JSON (an array, or `{"workers": [...]}`; by the `.json` extension). It is reread when its content
//! changes (checked every `workers_file_poll_ms`) and at once on SIGHUP or `POST
//! /admin/discovery/reload`. Each reread reconciles: engines that appeared are added and started,
//! engines that went are drained (no new requests; streams already on them run to their end), and
//! engines whose entry changed are replaced. An entry that fails to parse or validate is reported,
//! with its position, and the others still load; an engine it used to describe stays as it was.
//! Engines given in the configuration or by `--worker` are never touched by the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvgate_core::WorkerId;

use crate::config::WorkerSpec;
use crate::engines;
use crate::state::{AppState, DiscoveryStatus};

/// The entries of a workers file, each parsed on its own: the specs that are usable, and a message
/// per entry that is not.
pub fn parse(text: &str, json: bool) -> (Vec<WorkerSpec>, Vec<String>) {
    let entries: Result<Vec<serde_json::Value>, String> = if json {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Array(items)) => Ok(items),
            Ok(serde_json::Value::Object(mut o)) => match o.remove("workers") {
                Some(serde_json::Value::Array(items)) => Ok(items),
                _ => Err("expected an array of workers, or an object with a `workers` array".into()),
            },
            Ok(_) => Err("expected an array of workers, or an object with a `workers` array".into()),
            Err(e) => Err(format!("not JSON: {e}")),
        }
    } else {
        match toml::from_str::<toml::Table>(text) {
            Ok(mut t) => match t.remove("workers") {
                None => Ok(Vec::new()),
                Some(toml::Value::Array(items)) => items
                    .into_iter()
                    .map(|v| serde_json::to_value(v).map_err(|e| e.to_string()))
                    .collect::<Result<_, _>>(),
                Some(_) => Err("`workers` must be an array of tables ([[workers]])".into()),
            },
            Err(e) => Err(format!("not TOML: {}", e.message())),
        }
    };
    let entries = match entries {
        Ok(e) => e,
        Err(e) => return (Vec::new(), vec![e]),
    };
    let (mut specs, mut errors) = (Vec::new(), Vec::new());
    for (i, entry) in entries.into_iter().enumerate() {
        let what = entry
            .get("url")
            .and_then(|u| u.as_str())
            .map_or(format!("entry {}", i + 1), |u| format!("entry {} ({})", i + 1, crate::config::redact_url(u)));
        match serde_json::from_value::<WorkerSpec>(entry) {
            Ok(spec) => match spec.validate() {
                Ok(()) => specs.push(spec),
                Err(e) => errors.push(format!("{what}: {e}")),
            },
            Err(e) => errors.push(format!("{what}: {e}")),
        }
    }
    (specs, errors)
}

/// Watches `path` until the task is aborted: rereads it every `poll` when it changed, and at once
/// when `state.discovery_reload` is notified (SIGHUP).
pub async fn run(state: Arc<AppState>, path: PathBuf, poll: Duration) {
    let mut managed: BTreeMap<WorkerId, WorkerSpec> = BTreeMap::new();
    let mut last: Option<Result<String, String>> = None;
    let reload = state.discovery_reload.clone();
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let asked = tokio::select! {
            _ = tick.tick() => false,
            _ = reload.notified() => true,
        };
        let read = tokio::fs::read_to_string(&path).await.map_err(|e| format!("cannot read {}: {e}", path.display()));
        if !asked && last.as_ref() == Some(&read) {
            continue;
        }
        let errors = match &read {
            Ok(text) => {
                let (specs, mut errors) = parse(text, is_json(&path));
                errors.extend(reconcile(&state, &mut managed, specs));
                errors
            }
            // A missing file is reported, and the engines it listed stay until it is back.
            Err(e) => vec![e.clone()],
        };
        for e in &errors {
            tracing::warn!(file = %path.display(), error = %e, "workers file");
        }
        let status = DiscoveryStatus {
            path: Some(path.display().to_string()),
            reloads: state.discovery.lock().reloads + 1,
            workers: managed.keys().map(ToString::to_string).collect(),
            errors,
        };
        state.metrics.workers_file_reloads.inc();
        state.metrics.workers_file_errors.set(status.errors.len() as i64);
        tracing::info!(file = %path.display(), workers = status.workers.len(), errors = status.errors.len(), "workers file loaded");
        *state.discovery.lock() = status;
        last = Some(read);
    }
}

fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// Brings the engines the file manages in line with `wanted`; returns what could not be done.
fn reconcile(state: &AppState, managed: &mut BTreeMap<WorkerId, WorkerSpec>, wanted: Vec<WorkerSpec>) -> Vec<String> {
    let mut errors = Vec::new();
    let mut next: BTreeMap<WorkerId, WorkerSpec> = BTreeMap::new();
    for spec in wanted {
        let id = WorkerId::new(spec.id());
        if next.contains_key(&id) {
            errors.push(format!("worker {id} is listed twice; the first entry is used"));
            continue;
        }
        next.insert(id, spec);
    }
    for id in managed.keys().filter(|id| !next.contains_key(*id)).cloned().collect::<Vec<_>>() {
        // Drained: it takes no new request; streams already on it run to their end.
        if state.remove_engine(&id).is_ok() {
            tracing::info!(engine = %id, "worker gone from the workers file: drained");
        }
        managed.remove(&id);
    }
    let ctx = state.engine_context();
    for (id, spec) in next {
        match managed.get(&id) {
            Some(current) if *current == spec => continue,
            Some(_) => {
                let _ = state.remove_engine(&id);
                managed.remove(&id);
                tracing::info!(engine = %id, "worker changed in the workers file: replaced");
            }
            None => {}
        }
        match state.add_engine(&spec) {
            Ok(handle) => {
                engines::start(&ctx, &handle);
                tracing::info!(engine = %id, url = %spec.display_url(), "worker added from the workers file");
                managed.insert(id, spec);
            }
            Err(e) => errors.push(format!("worker {id}: {e}")),
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_entry_parses_on_its_own_and_a_bad_one_is_named() {
        let toml = "[[workers]]\nurl = \"http://a:1\"\n\n[[workers]]\nurl = \"http://b:2\"\ncolour = 3\n\n[[workers]]\nurl = \"ftp://c:3\"\n";
        let (specs, errors) = parse(toml, false);
        assert_eq!(specs.iter().map(|s| s.url.as_str()).collect::<Vec<_>>(), ["http://a:1"]);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].starts_with("entry 2 (http://b:2)") && errors[0].contains("colour"), "{errors:?}");
        assert!(errors[1].starts_with("entry 3"), "{errors:?}");
        let json = r#"{"workers": [{"url": "http://a:1", "kv_events": ":5557"}, {"nourl": 1}]}"#;
        let (specs, errors) = parse(json, true);
        assert_eq!((specs.len(), errors.len()), (1, 1), "{errors:?}");
        assert_eq!(parse(r#"[{"url": "http://a:1"}]"#, true).0.len(), 1);
        assert_eq!(parse("not [toml", false).1.len(), 1);
        assert!(parse("", false).0.is_empty() && parse("", false).1.is_empty(), "an empty file lists nobody");
    }
}
