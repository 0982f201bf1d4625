//! Real engines paced like GPUs (`scripts/real-engines/pacer/kvgate_pacer.py`): each scheduler step
//! of a real vLLM or SGLang engine takes the step time kvgate's engine model gives a GPU for its
//! batch, times a scale, so engines that share a few CPU cores stop slowing each other down.
//!
//! This module says how a fleet is paced (the profile and scale `engine.sh` hands the pacer), what
//! kvgate should be told about a paced engine's rates, and reads the step log the pacer writes.

use std::path::Path;

use anyhow::Context;
use kvgate_engine_model::EngineProfile;
use serde_json::Value;

/// How an engine is paced.
#[derive(Debug, Clone, PartialEq)]
pub struct Pacing {
    /// The modeled GPU (its step-time model).
    pub profile: EngineProfile,
    /// Wall seconds per modeled second: a CPU too slow to keep up with the GPU's own time runs the
    /// same schedule this many times slower.
    pub scale: f64,
}

/// The context a decode sequence is assumed to hold when a paced engine's full-batch decode rate is
/// given to kvgate: 4,096 tokens, as the simulator and the mock demo configure their routers, so a
/// paced real fleet and its simulation route on the same rates.
const DECODE_CONTEXT: u64 = 4096;

impl Pacing {
    /// What the real-engine suite, `kvgate demo --engines vllm|sglang` and the benches run: Llama 3
    /// 8B on one H100 (profile B), four times slower than the GPU. At that scale the tiny model's
    /// own compute is a fifth to a quarter of a decode step on this project's 2-core machines
    /// (docs/real-engines.md), which leaves room for four or five engines to step at once.
    pub fn cpu_default() -> Pacing {
        Pacing { profile: EngineProfile::llama3_8b_h100(), scale: 4.0 }
    }

    /// The environment `engine.sh` passes to the pacer.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let profile = serde_json::to_string(&self.profile).expect("a profile serializes");
        vec![("KVGATE_PACE_PROFILE", profile), ("KVGATE_PACE_SCALE", self.scale.to_string())]
    }

    /// Modeled wall time of a step, in milliseconds: the profile's time times the scale.
    pub fn step_ms(&self, decode_seqs: u64, decode_context: u64, prefill_tokens: u64) -> f64 {
        self.profile.step_micros(decode_seqs, decode_context, prefill_tokens) as f64 / 1000.0 * self.scale
    }

    /// New prefill tokens per second of a paced engine.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.profile.prefill_tokens_per_s / self.scale
    }

    /// Decode tokens per second of a full batch (the profile's `max_running` sequences of
    /// [`DECODE_CONTEXT`] tokens), as kvgate's `decode_tokens_per_s` is given.
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.profile.decode_tokens_per_s(u64::from(self.profile.max_running), DECODE_CONTEXT) / self.scale
    }

    /// The rates a kvgate `--worker` flag should carry for an engine paced this way.
    pub fn worker_options(&self) -> String {
        format!(
            ",prefill_tokens_per_s={:.0},decode_tokens_per_s={:.0}",
            self.prefill_tokens_per_s(),
            self.decode_tokens_per_s()
        )
    }
}

/// One step as the pacer logged it.
#[derive(Debug, Clone, PartialEq)]
pub struct PacedStep {
    /// Decode sequences in the step.
    pub decode_seqs: u64,
    /// Their context tokens.
    pub decode_context: u64,
    /// New prefill tokens.
    pub prefill_tokens: u64,
    /// The modeled wall time (profile time × scale), ms.
    pub target_ms: f64,
    /// What the engine's own work took (scheduling and the tiny model's compute), ms.
    pub compute_ms: f64,
    /// From the step's start to its results' release, ms.
    pub wall_ms: f64,
    /// The wall time (Unix seconds) the engine began the step.
    pub began_at: f64,
    /// The requests whose prompts first ran in this step.
    pub admitted: Vec<AdmittedRequest>,
    /// The engine's ids of the requests whose prompt this step completed, so whose first token it
    /// released (empty in logs written before the pacer logged them).
    pub first_tokens: Vec<String>,
}

/// A request as a paced step first ran its prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmittedRequest {
    /// The wall time (Unix seconds) the engine's API server took the request, before tokenizing it
    /// (the pacer carries SGLang's stamp to its scheduler). None where the stamp is missing.
    pub arrived_at: Option<f64>,
    /// The wall time the scheduler put it in its waiting queue (which it does between steps).
    pub queued_at: Option<f64>,
    /// Its prompt's tokens.
    pub prompt_tokens: u64,
    /// The engine's id for it, which its responses carry; None in logs written before the pacer
    /// logged it.
    pub request_id: Option<String>,
}

impl PacedStep {
    /// Parses one line of the pacer's log.
    pub fn parse(line: &str) -> anyhow::Result<PacedStep> {
        let v: Value = serde_json::from_str(line).context("a pace log line is not JSON")?;
        let count = |k: &str| v[k].as_u64().with_context(|| format!("a pace log line has no count {k}: {line}"));
        let ms = |k: &str| v[k].as_f64().with_context(|| format!("a pace log line has no time {k}: {line}"));
        Ok(PacedStep {
            decode_seqs: count("decode_seqs")?,
            decode_context: count("decode_context")?,
            prefill_tokens: count("prefill_tokens")?,
            target_ms: ms("target_ms")?,
            compute_ms: ms("compute_ms")?,
            wall_ms: ms("wall_ms")?,
            began_at: ms("began_at")?,
            admitted: admitted(&v["admitted"]).with_context(|| format!("a pace log line's admitted: {line}"))?,
            first_tokens: first_tokens(&v["first_tokens"])
                .with_context(|| format!("a pace log line's first_tokens: {line}"))?,
        })
    }

    /// From the scheduler queueing each admitted request to this step's start, seconds.
    pub fn queued_s(&self) -> impl Iterator<Item = f64> + '_ {
        self.admitted.iter().filter_map(|a| a.queued_at).map(|at| self.began_at - at)
    }

    /// Wall time over target: 1 is exact, above 1 late.
    pub fn lateness(&self) -> f64 {
        self.wall_ms / self.target_ms
    }
}

/// The `admitted` list of a pace log line: `[arrived, queued, prompt tokens, request id]`, the times
/// null where the engine kept no stamp (and no id in older logs).
fn admitted(v: &Value) -> anyhow::Result<Vec<AdmittedRequest>> {
    let time = |t: &Value, what: &str| -> anyhow::Result<Option<f64>> {
        if t.is_null() {
            Ok(None)
        } else {
            Ok(Some(t.as_f64().with_context(|| format!("{what} is not a time: {t}"))?))
        }
    };
    let list = v.as_array().context("not a list")?;
    list.iter()
        .map(|entry| {
            Ok(AdmittedRequest {
                arrived_at: time(&entry[0], "an arrival")?,
                queued_at: time(&entry[1], "a queueing")?,
                prompt_tokens: entry[2].as_u64().context("a prompt's tokens are not a count")?,
                request_id: match &entry[3] {
                    Value::Null => None,
                    id => Some(id.as_str().with_context(|| format!("a request id is not a string: {id}"))?.to_owned()),
                },
            })
        })
        .collect()
}

/// The `first_tokens` list of a pace log line: request ids (absent in older logs).
fn first_tokens(v: &Value) -> anyhow::Result<Vec<String>> {
    if v.is_null() {
        return Ok(Vec::new());
    }
    let list = v.as_array().context("not a list")?;
    list.iter()
        .map(|id| Ok(id.as_str().with_context(|| format!("a request id is not a string: {id}"))?.to_owned()))
        .collect()
}

/// Every step in a pacer's log file: none yet when the engine has not stepped since it started (the
/// pacer creates the file when the engine loads it). A missing file is an error: the engine is not
/// paced.
pub fn read_steps(path: &Path) -> anyhow::Result<Vec<PacedStep>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the pace log {} (is the engine paced?)", path.display()))?;
    text.lines().filter(|l| !l.trim().is_empty()).map(PacedStep::parse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_line_parses_and_its_lateness_is_wall_over_target() {
        let line = r#"{"t": 1.5, "runtime": "vllm", "step": 3, "decode_seqs": 4, "decode_context": 2413, "prefill_tokens": 2044, "model_ms": 65.629, "target_ms": 262.516, "compute_ms": 18.461, "wall_ms": 265.141, "began_at": 1.25, "admitted": [[1.1, 1.2, 2044, "cmpl-a-1f2e3d4c"], [null, null, 7]], "first_tokens": ["cmpl-a-1f2e3d4c"]}"#;
        let step = PacedStep::parse(line).unwrap();
        assert_eq!((step.decode_seqs, step.decode_context, step.prefill_tokens), (4, 2413, 2044));
        assert!((step.lateness() - 1.01).abs() < 1e-3);
        assert_eq!(step.admitted.len(), 2);
        assert_eq!(step.admitted[0].arrived_at, Some(1.1));
        assert_eq!(step.admitted[0].request_id.as_deref(), Some("cmpl-a-1f2e3d4c"));
        assert_eq!(
            step.admitted[1],
            AdmittedRequest { arrived_at: None, queued_at: None, prompt_tokens: 7, request_id: None }
        );
        assert_eq!(step.first_tokens, ["cmpl-a-1f2e3d4c"]);
        let queued: Vec<f64> = step.queued_s().collect();
        assert!(queued.len() == 1 && (queued[0] - 0.05).abs() < 1e-9, "{queued:?}");
        let bad = line.replace("[null, null, 7]", r#"[null, "soon", 7]"#);
        let why = format!("{:#}", PacedStep::parse(&bad).unwrap_err());
        assert!(why.contains("admitted") && why.contains("a queueing is not a time"), "{why}");
        let bad = line.replace(r#"["cmpl-a-1f2e3d4c"]}"#, "[7]}");
        let why = format!("{:#}", PacedStep::parse(&bad).unwrap_err());
        assert!(why.contains("first_tokens") && why.contains("not a string"), "{why}");
        let older = line.replace(r#", "first_tokens": ["cmpl-a-1f2e3d4c"]"#, "");
        assert!(PacedStep::parse(&older).unwrap().first_tokens.is_empty(), "a log without first tokens still reads");
        assert!(PacedStep::parse(r#"{"decode_seqs": 1}"#).unwrap_err().to_string().contains("decode_context"));
        assert!(PacedStep::parse("not json").is_err());
    }

    #[test]
    fn the_cpu_default_scales_the_profiles_rates() {
        let p = Pacing::cpu_default();
        assert_eq!(p.prefill_tokens_per_s(), 35_000.0 / 4.0);
        // 7 ms + 0.03 ms a sequence + 0.045 ms per 1k context, times 4.
        assert!((p.step_ms(64, 64 * 4096, 0) - 4.0 * 20.716).abs() < 0.01, "{}", p.step_ms(64, 64 * 4096, 0));
        assert!(p.worker_options().starts_with(",prefill_tokens_per_s=8750,decode_tokens_per_s="));
        let env = p.env();
        assert_eq!(env[1], ("KVGATE_PACE_SCALE", "4".to_string()));
        let profile: EngineProfile = serde_json::from_str(&env[0].1).unwrap();
        assert_eq!(profile, p.profile);
    }
}
