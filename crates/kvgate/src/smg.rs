//! Coming from SMG (the SGLang Model Gateway, PyPI `smg` 1.13): `kvgate serve` takes the SMG
//! flags that mean the same thing (aliases declared with the settings themselves, in
//! `kvgate_gateway::config::Overrides`) and refuses every other SMG flag with what to use instead,
//! before the command line is parsed. docs/migrating-from-smg.md maps each flag; a test checks that
//! every flag of `smg launch --help` is either accepted or listed here.

const PD: &str = "kvgate sends each request to one engine that does its prefill and its decode: prefill/decode (and encode) disaggregation is not supported";
const DISCOVERY: &str = "kvgate has no Kubernetes discovery: list the engines with --worker, watch a file of them with --workers-file (reread on change and on SIGHUP), or add and remove them at run time with POST /workers and DELETE /workers/{id}";
const DISCOVERY_FILE: &str = "kvgate watches a workers file of its own shape instead (TOML [[workers]] or JSON, each entry with its KV-event endpoints): --workers-file FILE, checked every workers_file_poll_ms ([discovery] in the config) and reread on SIGHUP";
const MEDIA: &str =
    "kvgate forwards multimodal inputs to the engines unchanged; it neither fetches nor preprocesses media";
const HISTORY: &str =
    "kvgate stores no conversations, responses or hooks: /v1/responses goes to the engine, which keeps its own store";
const PARSERS: &str = "kvgate passes responses through as the engine wrote them: reasoning and tool-call parsing is the engine's (vLLM's --reasoning-parser and --tool-call-parser)";
const TRANSPORT: &str = "kvgate picks each worker's protocol from its URL: http(s):// for an OpenAI server, grpc:// for SMG's gRPC worker protocol (vLLM or SGLang, from the service it serves or engine=); ZMQ workers are not supported, and every model the engines report is served without a separate mode";
const TREE: &str = "kvgate credits cache from the engines' own KV events, not from an approximate prefix tree or a placement map: use the projected policy's --escape-seconds and --escape-waiting, or cache_aware's --balance-abs and --balance-rel (docs/routing.md)";
const PREFIX_HASH: &str =
    "kvgate has no prefix_hash policy: --policy projected follows the prefix through the engines' KV events";
const LOAD: &str = "kvgate scores load in projected seconds from each engine's reported queue and its throughput (prefill_tokens_per_s, decode_tokens_per_s of each [[workers]] entry), polled every --poll-interval-ms";
const OVERLOAD: &str = "kvgate sheds with 429 and Retry-After when the best engine's projected wait exceeds --admission-wait-s, and its KV-pressure barrier puts full engines last";
const STICKY: &str =
    "kvgate has no sticky sessions: a conversation's requests follow its cached prefix through the KV events";
const DP: &str = "kvgate addresses a data-parallel engine as one worker with dp_size (each rank's KV events on its own port, [[workers]] in the file); it does not pick the rank";
const LIFECYCLE: &str = "kvgate probes every engine from the start and keeps it registered: it is in rotation while /health passes (--health-interval-ms, --failures-to-open) and it is not ejected by passive health (outlier_failures, outlier_ejection_s); a stalled stream ends after stream_idle_timeout_s";
const HEALTH: &str = "kvgate probes GET /health on every engine every --health-interval-ms (timeout: the interval, within 1 to 5 s); one passing probe brings an engine back; /health and /ready are served on kvgate's own port";
const BREAKER: &str = "kvgate's circuit breaker is passive health: outlier_failures failures in a row eject an engine for outlier_ejection_s times its ejections in a row ([telemetry] in the file)";
const RETRY: &str = "kvgate retries a failed request at once on another engine (at most 3 engines) while the client has seen no byte, and never on the same engine; there is nothing to tune";
const TENANCY: &str = "kvgate has no tenants, priorities or rate limits: it admits by projected wait (--admission-wait-s) and caps connections (max_connections in [server])";
const CONNECTIONS: &str = "kvgate bounds connections with [server] keys instead: header_timeout_ms (which also closes idle keep-alive connections), body_timeout_s, max_buffered_body_bytes (one budget for all bodies), stream_idle_timeout_s and upstream_keepalive_ms; it speaks HTTP/1.1 to engines and sends no SSE keep-alives";
const TLS: &str = "kvgate speaks plain HTTP, to clients and to engines: terminate TLS in front of it (a load balancer, nginx, a service mesh)";
const CONTROL_AUTH: &str =
    "kvgate guards /admin and /workers with one --admin-key; there are no control-plane roles, JWT or audit log";
const METRICS: &str = "kvgate serves /metrics on its own --host and --port, with fixed buckets";
const OBSERVABILITY: &str = "kvgate logs to stderr (--log-format json for JSON), sets x-kvgate-request-id on answers and x-request-id towards engines, and has no tracing export, log files or heap profiles";
const CONTROL_PLANE: &str = "kvgate applies worker changes at once (no job queue), runs replicas independently (no mesh), and has no RL control plane or CORS";
const TOKENIZER: &str = "kvgate reads a local tokenizer only: --tokenizer DIR (the model's directory holding tokenizer.json) or --tokenizer FILE; no hub downloads, no tokenizer cache; without --tokenizer, gRPC workers hand over their own (GetTokenizer) and HTTP engines get the built-in tokenizer";

/// SMG `launch` flags with no kvgate equivalent, and why (or what to use instead).
pub const REFUSED: &[(&str, &str)] = &[
    ("--pd-disaggregation", PD),
    ("--epd-disaggregation", PD),
    ("--prefill", PD),
    ("--decode", PD),
    ("--encode", PD),
    ("--prefill-policy", PD),
    ("--decode-policy", PD),
    ("--encode-policy", PD),
    ("--prefill-selector", PD),
    ("--decode-selector", PD),
    ("--encode-selector", PD),
    ("--prefill-max-inflight-requests-per-worker", PD),
    ("--prefill-queue-size", PD),
    ("--prefill-queue-timeout-secs", PD),
    ("--pd-admission-wait-secs", PD),
    ("--bucket-adjust-interval-secs", PD),
    ("--service-discovery", DISCOVERY),
    ("--discovery-provider", DISCOVERY),
    ("--selector", DISCOVERY),
    ("--service-discovery-port", DISCOVERY),
    ("--service-discovery-namespace", DISCOVERY),
    ("--kv-connector-annotation", DISCOVERY),
    ("--kv-engine-id-annotation", DISCOVERY),
    ("--router-selector", DISCOVERY),
    ("--model-id-from", DISCOVERY),
    ("--discovery-file", DISCOVERY_FILE),
    ("--discovery-check-interval-secs", DISCOVERY_FILE),
    ("--multimodal-tensor-transport", MEDIA),
    ("--multimodal-shm-min-bytes", MEDIA),
    ("--multimodal-max-inflight-bytes", MEDIA),
    ("--mm-per-request-image-limit", MEDIA),
    ("--mm-processing", MEDIA),
    ("--mm-pixel-cache-mb", MEDIA),
    ("--mm-pixel-rdma", MEDIA),
    ("--mm-allowed-media-domains", MEDIA),
    ("--mm-allow-private-media-hosts", MEDIA),
    ("--rdma-listen-ip", MEDIA),
    ("--rdma-slot-ttl-s", MEDIA),
    ("--log-mm-timing", MEDIA),
    ("--history-backend", HISTORY),
    ("--history-memory-max-responses", HISTORY),
    ("--history-memory-max-items", HISTORY),
    ("--history-memory-retention-secs", HISTORY),
    ("--schema-config", HISTORY),
    ("--oracle-wallet-path", HISTORY),
    ("--oracle-tns-alias", HISTORY),
    ("--oracle-connect-descriptor", HISTORY),
    ("--oracle-username", HISTORY),
    ("--oracle-password", HISTORY),
    ("--oracle-external-auth", HISTORY),
    ("--oracle-pool-min", HISTORY),
    ("--oracle-pool-max", HISTORY),
    ("--oracle-pool-timeout-secs", HISTORY),
    ("--postgres-db-url", HISTORY),
    ("--postgres-pool-max", HISTORY),
    ("--postgres-op-timeout-secs", HISTORY),
    ("--redis-url", HISTORY),
    ("--redis-pool-max", HISTORY),
    ("--redis-retention-days", HISTORY),
    ("--redis-op-timeout-secs", HISTORY),
    ("--max-background-responses", HISTORY),
    ("--enable-wasm", HISTORY),
    ("--storage-hook-wasm-path", HISTORY),
    ("--storage-context-headers", HISTORY),
    ("--mcp-config-path", HISTORY),
    ("--parser", PARSERS),
    ("--reasoning-parser", PARSERS),
    ("--tool-call-parser", PARSERS),
    ("--backend", TRANSPORT),
    ("--zmq-engine-count", TRANSPORT),
    ("--enable-igw", TRANSPORT),
    ("--model-alias", TRANSPORT),
    ("--cache-threshold", TREE),
    ("--max-tree-size", TREE),
    ("--eviction-interval-secs", TREE),
    ("--cache-boundaries", TREE),
    ("--cache-index", TREE),
    ("--cache-ttl-secs", TREE),
    ("--kv-index", TREE),
    ("--selection-policy", TREE),
    ("--selection-accounting-ttl-ms", TREE),
    ("--overlap-decay", TREE),
    ("--selection-temperature", TREE),
    ("--worker-warmup-secs", TREE),
    ("--worker-warmup-share", TREE),
    ("--worker-warmup-blocks", TREE),
    ("--worker-warmup-thin-ratio", TREE),
    ("--worker-warmup-divert-every", TREE),
    ("--balance-token-usage-threshold", TREE),
    ("--overload-token-usage-threshold", TREE),
    ("--prefix-token-count", PREFIX_HASH),
    ("--prefix-hash-load-factor", PREFIX_HASH),
    ("--prefix-hash-balance-abs-threshold", PREFIX_HASH),
    ("--least-load-kv-pressure-weight", LOAD),
    ("--least-load-default-throughput", LOAD),
    ("--least-load-mean-prefill-tokens", LOAD),
    ("--least-load-max-waiting-requests", LOAD),
    ("--power-of-two-load-metric", LOAD),
    ("--load-monitor-interval", LOAD),
    ("--disable-load-monitoring", LOAD),
    ("--worker-overload-waiting-requests", OVERLOAD),
    ("--worker-overload-token-usage", OVERLOAD),
    ("--worker-overload-protection", OVERLOAD),
    ("--disable-worker-overload-protection", OVERLOAD),
    ("--worker-overload-shed", OVERLOAD),
    ("--routing-key-override", STICKY),
    ("--routing-key-headers", STICKY),
    ("--max-idle-secs", STICKY),
    ("--assignment-mode", STICKY),
    ("--dp-aware", DP),
    ("--dp-minimum-tokens-scheduler", DP),
    ("--worker-startup-timeout-secs", LIFECYCLE),
    ("--worker-startup-delay", LIFECYCLE),
    ("--worker-startup-check-interval", LIFECYCLE),
    ("--worker-stall-secs", LIFECYCLE),
    ("--worker-wedge-secs", LIFECYCLE),
    ("--worker-stale-secs", LIFECYCLE),
    ("--remove-unhealthy-workers", LIFECYCLE),
    ("--no-remove-unhealthy-workers", LIFECYCLE),
    ("--worker-auto-recovery", LIFECYCLE),
    ("--no-worker-auto-recovery", LIFECYCLE),
    ("--health-success-threshold", HEALTH),
    ("--health-check-timeout-secs", HEALTH),
    ("--health-check-endpoint", HEALTH),
    ("--disable-health-check", HEALTH),
    ("--health-check-port", HEALTH),
    ("--cb-failure-threshold", BREAKER),
    ("--cb-success-threshold", BREAKER),
    ("--cb-timeout-duration-secs", BREAKER),
    ("--cb-window-duration-secs", BREAKER),
    ("--disable-circuit-breaker", BREAKER),
    ("--retry-max-retries", RETRY),
    ("--retry-initial-backoff-ms", RETRY),
    ("--retry-max-backoff-ms", RETRY),
    ("--retry-backoff-multiplier", RETRY),
    ("--retry-jitter-factor", RETRY),
    ("--disable-retries", RETRY),
    ("--max-concurrent-requests", TENANCY),
    ("--rate-limit-tokens-per-second", TENANCY),
    ("--tenant-api-key", TENANCY),
    ("--trust-tenant-header", TENANCY),
    ("--tenant-header-name", TENANCY),
    ("--priority-scheduler-enabled", TENANCY),
    ("--priority-scheduler-default-max-class", TENANCY),
    ("--priority-scheduler-config", TENANCY),
    ("--priority-scheduler-tenant-metric-top-n", TENANCY),
    ("--tenant-rate-limit-enabled", TENANCY),
    ("--tenant-rate-limit-config", TENANCY),
    ("--idle-connection-timeout-secs", CONNECTIONS),
    ("--stream-body-stall-timeout-secs", CONNECTIONS),
    ("--max-buffered-request-bytes", CONNECTIONS),
    ("--sse-keepalive-secs", CONNECTIONS),
    ("--upstream-http2", CONNECTIONS),
    ("--upstream-pool-idle-timeout-secs", CONNECTIONS),
    ("--tls-cert-path", TLS),
    ("--tls-key-path", TLS),
    ("--client-cert-path", TLS),
    ("--client-key-path", TLS),
    ("--ca-cert-paths", TLS),
    ("--control-plane-api-keys", CONTROL_AUTH),
    ("--control-plane-audit-enabled", CONTROL_AUTH),
    ("--jwt-issuer", CONTROL_AUTH),
    ("--jwt-audience", CONTROL_AUTH),
    ("--jwt-jwks-uri", CONTROL_AUTH),
    ("--jwt-role-mapping", CONTROL_AUTH),
    ("--prometheus-port", METRICS),
    ("--prometheus-host", METRICS),
    ("--prometheus-duration-buckets", METRICS),
    ("--enable-trace", OBSERVABILITY),
    ("--otlp-traces-endpoint", OBSERVABILITY),
    ("--log-dir", OBSERVABILITY),
    ("--jemalloc-prof-dir", OBSERVABILITY),
    ("--request-id-headers", OBSERVABILITY),
    ("--job-queue-capacity", CONTROL_PLANE),
    ("--job-queue-concurrency", CONTROL_PLANE),
    ("--enable-rl", CONTROL_PLANE),
    ("--rl-control-timeout-secs", CONTROL_PLANE),
    ("--rl-fanout-concurrency", CONTROL_PLANE),
    ("--enable-mesh", CONTROL_PLANE),
    ("--mesh-server-name", CONTROL_PLANE),
    ("--mesh-host", CONTROL_PLANE),
    ("--mesh-advertise-host", CONTROL_PLANE),
    ("--mesh-port", CONTROL_PLANE),
    ("--mesh-peer-urls", CONTROL_PLANE),
    ("--mesh-tls-ca-cert", CONTROL_PLANE),
    ("--mesh-tls-cert", CONTROL_PLANE),
    ("--mesh-tls-key", CONTROL_PLANE),
    ("--cors-allowed-origins", CONTROL_PLANE),
    ("--model", TOKENIZER),
    ("--disable-tokenizer-autoload", TOKENIZER),
    ("--tokenizer-cache-enable-l0", TOKENIZER),
    ("--tokenizer-cache-l0-max-entries", TOKENIZER),
    ("--tokenizer-cache-enable-l1", TOKENIZER),
    ("--tokenizer-cache-l0-max-memory", TOKENIZER),
    ("--tokenizer-cache-l1-max-memory", TOKENIZER),
];

/// SMG `launch` flags `kvgate serve` accepts with the same meaning (spelled as SMG spells them).
#[cfg_attr(not(test), allow(dead_code))] // documents the split; the tests check it against clap
pub const ACCEPTED: &[&str] = &[
    "--host",
    "--port",
    "--worker-urls",
    "--policy",
    "--api-key",
    "--max-payload-size",
    "--request-timeout-secs",
    "--log-level",
    "--log-json",
    "--shutdown-grace-period-secs",
    "--health-check-interval-secs",
    "--health-failure-threshold",
    "--queue-size",
    "--queue-timeout-secs",
    "--header-read-timeout-secs",
    "--balance-abs-threshold",
    "--balance-rel-threshold",
    "--block-size",
    "--chat-template",
    "--tokenizer-path",
    "--model-path",
];

/// SMG's `--model-path DIR`, which SMG's gRPC mode is launched with (the model's directory, where it
/// reads the tokenizer): kvgate reads the tokenizer from it too (`--tokenizer DIR`), unless the line
/// names the tokenizer itself (`--tokenizer-path`, as SMG's gRPC launch lines also do), which wins.
pub fn translate(args: Vec<String>) -> Vec<String> {
    let names_tokenizer = args.iter().any(|a| {
        let flag = a.split('=').next().unwrap_or(a);
        matches!(flag, "--tokenizer" | "--tokenizer-path")
    });
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let value = if arg == "--model-path" {
            it.next()
        } else if let Some(v) = arg.strip_prefix("--model-path=") {
            Some(v.to_owned())
        } else {
            out.push(arg);
            continue;
        };
        if let (Some(v), false) = (value, names_tokenizer) {
            out.push("--tokenizer".into());
            out.push(v);
        }
    }
    out
}

/// Refuses the first SMG-only flag among `args` (`--flag` or `--flag=value`), naming what to use.
pub fn check(args: &[String]) -> anyhow::Result<()> {
    for arg in args {
        let Some(flag) = arg.strip_prefix("--").map(|f| f.split('=').next().unwrap_or(f)) else { continue };
        if let Some((name, instead)) = REFUSED.iter().find(|(name, _)| name[2..] == *flag) {
            anyhow::bail!("{name} is an SMG flag kvgate does not take: {instead} (docs/migrating-from-smg.md)");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// Every flag of `smg launch --help` (SMG 1.13.0), one per line.
    const SMG_FLAGS: &str = include_str!("../tests/data/smg-1.13-launch-flags.txt");

    /// A value SMG would take for each accepted flag (`None`: a switch).
    fn sample(flag: &str) -> Option<&'static str> {
        Some(match flag {
            "--host" => "0.0.0.0",
            "--port" => "30000",
            "--worker-urls" => "http://10.0.0.1:8000",
            "--policy" => "cache_aware",
            "--api-key" => "K",
            "--max-payload-size" => "536870912",
            "--request-timeout-secs" => "1800",
            "--log-level" => "debug",
            "--log-json" => return None,
            "--shutdown-grace-period-secs" => "180",
            "--health-check-interval-secs" => "60",
            "--health-failure-threshold" => "3",
            "--queue-size" => "100",
            "--queue-timeout-secs" => "60",
            "--header-read-timeout-secs" => "30",
            "--balance-abs-threshold" => "64",
            "--balance-rel-threshold" => "1.5",
            "--block-size" => "16",
            "--chat-template" => "template.jinja",
            "--tokenizer-path" => "/models/m",
            "--model-path" => "/models/m",
            other => panic!("no sample value for {other}"),
        })
    }

    #[test]
    fn every_smg_flag_is_either_accepted_by_kvgate_serve_or_refused_with_a_reason() {
        let flags: Vec<&str> = SMG_FLAGS.lines().filter(|l| !l.is_empty()).collect();
        assert!(flags.len() > 200, "the SMG 1.13 flag list");
        for flag in flags {
            let refused = REFUSED.iter().any(|(f, _)| *f == flag);
            assert!(refused || ACCEPTED.contains(&flag), "{flag} is neither accepted nor refused");
            if refused {
                continue;
            }
            let mut args: Vec<String> = vec!["kvgate".into(), "serve".into(), flag.into()];
            args.extend(sample(flag).map(str::to_owned));
            if let Err(e) = crate::Cli::try_parse_from(translate(args)) {
                panic!("kvgate serve does not take {flag}: {e}");
            }
        }
    }

    #[test]
    fn smgs_model_path_names_the_tokenizer_unless_the_line_names_it_itself() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            translate(args(&["--model-path", "/m", "--port", "1"])),
            args(&["--tokenizer", "/m", "--port", "1"])
        );
        assert_eq!(translate(args(&["--model-path=/m"])), args(&["--tokenizer", "/m"]));
        // SMG's gRPC launch line gives both: the tokenizer path wins, the model path goes.
        let grpc_line = args(&["--worker-urls", "grpc://h:1", "--model-path", "/m", "--tokenizer-path", "/t"]);
        assert_eq!(translate(grpc_line), args(&["--worker-urls", "grpc://h:1", "--tokenizer-path", "/t"]));
        let parsed = crate::Cli::try_parse_from(translate(args(&["kvgate", "serve", "--model-path", "/m"])));
        assert!(parsed.is_ok(), "{parsed:?}");
    }

    #[test]
    fn the_migration_guide_names_every_smg_flag() {
        let doc = include_str!("../../../docs/migrating-from-smg.md");
        for flag in SMG_FLAGS.lines().filter(|l| !l.is_empty()) {
            assert!(
                doc.contains(&format!("`{flag}`")) || doc.contains(&format!("`{flag} ")),
                "docs/migrating-from-smg.md lacks {flag}"
            );
        }
    }

    #[test]
    fn a_refused_flag_is_named_with_what_to_use_instead_and_kvgate_flags_pass() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let err = check(&args(&["--worker-urls", "http://a:1", "--prometheus-port=29000"])).unwrap_err().to_string();
        assert!(err.starts_with("--prometheus-port is an SMG flag"), "{err}");
        assert!(err.contains("/metrics on its own --host and --port"), "{err}");
        check(&args(&["--worker-urls", "http://a:1", "--policy", "cache_aware", "--api-key", "K"])).unwrap();
        assert!(REFUSED.iter().all(|(f, _)| !ACCEPTED.contains(f)), "a flag is either accepted or refused");
    }
}
