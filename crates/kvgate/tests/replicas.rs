//! Several `kvgate serve` processes sharing reservations over a real `nats-server` (Debian's, which
//! `scripts/setup-nats.sh` installs), in front of mock engines.
#![allow(clippy::disallowed_methods)] // black-box tests wait on real processes against wall-clock deadlines

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvgate_mock_engine::{MockConfig, MockEngine};
use serde_json::{json, Value};

/// How long a silent peer lasts in these tests; the heartbeat is the default 1 s.
const EXPIRY_MS: u64 = 2500;

/// One test at a time: each runs a NATS server, up to four gateways and three engines, and on two
/// cores several such fleets at once would delay the bus past what the burst test allows.
static ONE_FLEET_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn nats_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let candidates = std::env::var_os("KVGATE_NATS_SERVER")
        .map(PathBuf::from)
        .into_iter()
        .chain(std::env::split_paths(&path).map(|d| d.join("nats-server")))
        .chain([PathBuf::from("/usr/sbin/nats-server")]);
    for c in candidates {
        if c.is_file() {
            return c;
        }
    }
    panic!("nats-server is not installed: run scripts/setup-nats.sh (Debian's nats-server), or set KVGATE_NATS_SERVER");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A `nats-server` on loopback.
struct Nats {
    child: Option<Child>,
    port: u16,
}

impl Nats {
    fn start() -> Nats {
        let mut n = Nats { child: None, port: free_port() };
        n.restart();
        n
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on its port and waits until it accepts connections.
    fn restart(&mut self) {
        let child = Command::new(nats_binary())
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not listen on {}", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One `kvgate serve` replica.
struct Replica {
    child: Child,
    url: String,
}

impl Replica {
    fn start(id: &str, nats: &Nats, engines: &[MockEngine]) -> Replica {
        Replica::start_with(id, nats, engines, 100, true)
    }

    /// A replica that polls the engines' load every `poll_ms`, and follows their KV events or not.
    fn start_with(id: &str, nats: &Nats, engines: &[MockEngine], poll_ms: u64, kv_events: bool) -> Replica {
        Replica::start_configured(id, nats, engines, poll_ms, kv_events, "")
    }

    /// [`Replica::start_with`], with `config` as its TOML configuration file.
    fn start_configured(
        id: &str,
        nats: &Nats,
        engines: &[MockEngine],
        poll_ms: u64,
        kv_events: bool,
        config: &str,
    ) -> Replica {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
        cmd.args(["serve", "--log-format", "json", "--port", "0", "--poll-interval-ms", &poll_ms.to_string()]).args([
            "--replica-bus",
            &nats.url(),
            "--replica-id",
            id,
            "--replica-expiry-ms",
            &EXPIRY_MS.to_string(),
        ]);
        if !config.is_empty() {
            let path =
                std::env::temp_dir().join(format!("kvgate-replica-{}-{id}-{}.toml", std::process::id(), nats.port));
            std::fs::write(&path, config).expect("write the replica's configuration");
            cmd.arg("--config").arg(path);
        }
        for (i, e) in engines.iter().enumerate() {
            let events =
                if kv_events { format!(",kv_events={},replay={}", e.kv_events, e.replay) } else { String::new() };
            cmd.arg("--worker").arg(format!("{},id=e{i},engine=vllm{events}", e.url));
        }
        let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().expect("spawn kvgate serve");
        let addr = support::listening_address(&mut child);
        Replica { child, url: format!("http://{addr}") }
    }

    async fn get(&self, path: &str) -> Value {
        reqwest::get(format!("{}{path}", self.url)).await.unwrap().json().await.unwrap()
    }

    /// Per engine: (this replica's own in-flight requests, its peers' as it sees them).
    async fn in_flight(&self) -> BTreeMap<String, (u64, u64)> {
        let v = self.get("/admin/workers").await;
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                let r = &w["router"];
                (
                    w["id"].as_str().unwrap().to_owned(),
                    (r["in_flight"].as_u64().unwrap(), r["peer_in_flight"].as_u64().unwrap()),
                )
            })
            .collect()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn engines(n: u64) -> Vec<MockEngine> {
    let mut out = Vec::new();
    for seed in 1..=n {
        out.push(MockEngine::start(MockConfig { seed, ..MockConfig::default() }).await.unwrap());
    }
    out
}

/// Polls `check` every 50 ms until it returns `Some`, for at most `limit`.
async fn eventually<T, F: std::future::Future<Output = Option<T>>>(
    limit: Duration,
    what: &str,
    mut check: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every replica has the bus and hears all the others.
async fn wait_connected(replicas: &[&Replica]) {
    for r in replicas {
        eventually(Duration::from_secs(15), "every replica connected and hearing its peers", || async {
            let v = r.get("/admin/replicas").await;
            (v["connected"] == true && v["peers"].as_array().is_some_and(|p| p.len() == replicas.len() - 1))
                .then_some(())
        })
        .await;
    }
}

fn chat(prefix: &str, i: usize, max_tokens: u64, stream: bool) -> Value {
    json!({"model": "mock-model", "max_tokens": max_tokens, "stream": stream, "ignore_eos": true,
           "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": format!("question {i}")}]})
}

fn long_prefix(tag: &str) -> String {
    (0..300).map(|i| format!("{tag}{i}")).collect::<Vec<_>>().join(" ")
}

/// Sends `n` requests 30 ms apart, round-robin over `replicas`, all overlapping; returns how many
/// each engine served.
async fn burst(replicas: &[&Replica], engines: &[MockEngine], prefix: &str, n: usize) -> Vec<u64> {
    use std::sync::atomic::Ordering::Relaxed;
    let before: Vec<u64> = engines.iter().map(|e| e.shared.finished.load(Relaxed)).collect();
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..n {
        let url = format!("{}/v1/chat/completions", replicas[i % replicas.len()].url);
        let body = chat(prefix, i, 200, false);
        let client = client.clone();
        tasks.push(tokio::spawn(async move { client.post(url).json(&body).send().await.map(|r| r.status().as_u16()) }));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), 200);
    }
    engines.iter().zip(before).map(|(e, b)| e.shared.finished.load(Relaxed) - b).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_across_replicas_spreads_as_well_as_through_one() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let nats = Nats::start();
    let engines = engines(3).await;
    // Load reports every 2 s and no cache credit: a burst of 24 identical-prefix requests over 720 ms
    // is placed on reservations alone, which is what the replicas share. (With KV events the owner's
    // credit makes the split depend on when its events land, run to run.)
    let replicas: Vec<Replica> =
        (0..3).map(|i| Replica::start_with(&format!("r{i}"), &nats, &engines, 2000, false)).collect();
    let all: Vec<&Replica> = replicas.iter().collect();
    wait_connected(&all).await;
    let one = burst(&all[..1], &engines, &long_prefix("alpha"), 24).await;
    let three = burst(&all, &engines, &long_prefix("beta"), 24).await;
    eprintln!("24 shared-prefix requests per engine: through one replica {one:?}, round-robin over three {three:?}");
    // Replicas blind to each other pile onto whichever engine each thinks is idle (seen here with the
    // sharing switched off: 4/20/0, 16/0/8, 2/10/12 where one replica spread 8/8/8). Sharing matches
    // one replica to within one request (a load report landing mid-burst can shift one).
    let peak = |c: &[u64]| c.iter().copied().max().unwrap();
    assert!(peak(&three) <= peak(&one) + 1, "three replicas piled more on one engine: {three:?} against {one:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_counts_each_request_once_its_own_included() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let nats = Nats::start();
    let engines = engines(3).await;
    let replicas: Vec<Replica> = (0..3).map(|i| Replica::start(&format!("r{i}"), &nats, &engines)).collect();
    let all: Vec<&Replica> = replicas.iter().collect();
    wait_connected(&all).await;
    // Nine long streams, three through each replica, held open.
    let client = reqwest::Client::new();
    let mut streams = Vec::new();
    for i in 0..9 {
        let resp = client
            .post(format!("{}/v1/chat/completions", replicas[i % 3].url))
            .json(&chat(&long_prefix("hold"), i, 5000, true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        streams.push(resp);
    }
    let views = eventually(Duration::from_secs(10), "every replica sees all nine requests, each once", || async {
        let mut views = Vec::new();
        for r in &replicas {
            views.push(r.in_flight().await);
        }
        let truth: BTreeMap<&String, u64> = views[0].keys().map(|e| (e, views.iter().map(|v| v[e].0).sum())).collect();
        let total: u64 = truth.values().sum();
        let agree = views.iter().all(|v| v.iter().all(|(e, (own, peers))| own + peers == truth[e]));
        (total == 9 && agree).then_some(views)
    })
    .await;
    eprintln!("per replica, per engine (own, peers'): {views:?}");
    for r in &replicas {
        let v = r.get("/admin/replicas").await;
        assert_eq!(v["own_echoes"], 0, "replicas subscribe with no_echo: the server keeps their own messages: {v}");
        assert_eq!(v["duplicate_id"], 0, "{v}");
        assert_eq!((v["garbage"].as_u64(), v["applied"]["unknown_worker"].as_u64()), (Some(0), Some(0)), "{v}");
    }
    // A second process under r0's id is reported, not silently merged.
    let twin = Replica::start("r0", &nats, &engines);
    eventually(Duration::from_secs(10), "r0 reports another process using its id", || async {
        (replicas[0].get("/admin/replicas").await["duplicate_id"].as_u64().unwrap() > 0).then_some(())
    })
    .await;
    drop(twin);
    // Closing the streams releases them everywhere.
    drop(streams);
    for r in &replicas {
        eventually(Duration::from_secs(10), "all reservations released on every replica", || async {
            r.in_flight().await.values().all(|&(own, peers)| own == 0 && peers == 0).then_some(())
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_reservations_expire_on_the_others() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let nats = Nats::start();
    let engines = engines(2).await;
    let (a, mut c) = (Replica::start("a", &nats, &engines), Replica::start("c", &nats, &engines));
    wait_connected(&[&a, &c]).await;
    let client = reqwest::Client::new();
    let mut streams = Vec::new();
    for i in 0..4 {
        let resp = client
            .post(format!("{}/v1/chat/completions", c.url))
            .json(&chat("held by c", i, 5000, true))
            .send()
            .await
            .unwrap();
        streams.push(resp);
    }
    let peers_of_a = || async { a.in_flight().await.values().map(|v| v.1).sum::<u64>() };
    eventually(Duration::from_secs(10), "a sees c's four requests", || async {
        (peers_of_a().await == 4).then_some(())
    })
    .await;
    let _ = c.child.kill();
    let killed = Instant::now();
    assert_eq!(peers_of_a().await, 4, "kept until c has been silent for the expiry");
    let bound = Duration::from_millis(EXPIRY_MS + 2000) + Duration::from_secs(2);
    eventually(bound, "c's reservations gone from a", || async { (peers_of_a().await == 0).then_some(()) }).await;
    eprintln!(
        "c's reservations expired on a {:?} after c was killed (expiry {EXPIRY_MS} ms, heartbeat 1 s)",
        killed.elapsed()
    );
    let v = a.get("/admin/replicas").await;
    assert_eq!((v["peers_expired"].as_u64(), v["peers"].as_array().map(Vec::len)), (Some(1), Some(0)), "{v}");
    drop(streams);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_bus_fails_no_request_and_sharing_resumes() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let mut nats = Nats::start();
    let engines = engines(3).await;
    let replicas: Vec<Replica> = (0..3).map(|i| Replica::start(&format!("r{i}"), &nats, &engines)).collect();
    let all: Vec<&Replica> = replicas.iter().collect();
    wait_connected(&all).await;
    let client = reqwest::Client::new();
    let send = |i: usize| {
        let client = client.clone();
        let url = format!("{}/v1/chat/completions", replicas[i % 3].url);
        async move { client.post(url).json(&chat("steady", i, 8, false)).send().await.map(|r| r.status().as_u16()) }
    };
    let mut statuses = BTreeMap::<String, usize>::new();
    let mut record = |s: Result<u16, reqwest::Error>| {
        *statuses.entry(s.map_or_else(|e| e.to_string(), |c| c.to_string())).or_default() += 1;
    };
    for i in 0..20 {
        record(send(i).await);
    }
    nats.kill();
    eventually(Duration::from_secs(10), "r0 says the bus is lost", || async {
        (replicas[0].get("/admin/replicas").await["connected"] == false).then_some(())
    })
    .await;
    for i in 20..40 {
        record(send(i).await);
    }
    nats.restart();
    for i in 40..60 {
        record(send(i).await);
    }
    assert_eq!(statuses.get("200"), Some(&60), "{statuses:?}");
    wait_connected(&all).await;
    // Sharing works again: r1's new request reaches r0's view.
    let held = client
        .post(format!("{}/v1/chat/completions", replicas[1].url))
        .json(&chat("after the outage", 0, 5000, true))
        .send()
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "r0 sees r1's request after the bus came back", || async {
        (replicas[0].in_flight().await.values().map(|v| v.1).sum::<u64>() == 1).then_some(())
    })
    .await;
    let v = replicas[0].get("/admin/replicas").await;
    assert!(v["dropped"].as_u64().unwrap() > 0, "heartbeats during the outage are dropped, not queued: {v}");
    drop(held);
}

/// Sends one short request to each replica in the same instant, `rounds` times, `gap` apart, and
/// returns per round the engines the replicas chose, from their decision logs.
async fn rounds_at_once(replicas: &[&Replica], rounds: usize, gap: Duration, tag: &str) -> Vec<Vec<String>> {
    let client = reqwest::Client::new();
    for round in 0..rounds {
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(replicas.len()));
        let mut tasks = Vec::new();
        for (r, replica) in replicas.iter().enumerate() {
            let (client, start) = (client.clone(), start.clone());
            let url = format!("{}/v1/chat/completions", replica.url);
            let body = chat(&format!("{tag} round {round} replica {r}"), round, 40, false);
            tasks.push(tokio::spawn(async move {
                start.wait().await;
                client.post(url).json(&body).send().await.map(|resp| resp.status().as_u16())
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap(), 200);
        }
        tokio::time::sleep(gap).await;
    }
    let mut logs = Vec::new();
    for r in replicas {
        let log = r.get(&format!("/admin/decisions?limit={rounds}")).await;
        let workers: Vec<String> = log["decisions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["decision"]["worker"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(workers.len(), rounds, "{log}");
        logs.push(workers);
    }
    (0..rounds).map(|round| logs.iter().map(|l| l[round].clone()).collect()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reaching_every_replica_at_once_are_staggered_onto_different_engines() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let nats = Nats::start();
    let engines = engines(3).await;
    // No KV events and slow load reports: the replicas see the same fleet, through the reservations
    // they share, so every one of them finds the same engine best. On two cores shared by three
    // gateways, three engines, NATS and the client, a bus hop takes a few milliseconds, not the
    // fraction of one it takes between real hosts: the stagger is widened to match.
    let config = "[replicas]\nstagger_ms = 30\n";
    let replicas: Vec<Replica> =
        (0..3).map(|i| Replica::start_configured(&format!("r{i}"), &nats, &engines, 2000, false, config)).collect();
    let all: Vec<&Replica> = replicas.iter().collect();
    wait_connected(&all).await;
    // Two long streams through one replica take two engines: the third is the best for every
    // request that follows, at every replica.
    let client = reqwest::Client::new();
    let mut held = Vec::new();
    for i in 0..2 {
        let resp = client
            .post(format!("{}/v1/chat/completions", replicas[0].url))
            .json(&chat(&long_prefix("held"), i, 5000, true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        held.push(resp);
    }
    for r in &replicas {
        eventually(Duration::from_secs(10), "every replica sees the two held streams", || async {
            let busy = r.in_flight().await.values().filter(|&&(own, peers)| own + peers > 0).count();
            (busy == 2).then_some(())
        })
        .await;
    }
    let gap = Duration::from_millis(300);
    let herded = |rounds: &[Vec<String>]| rounds.iter().filter(|r| r.iter().all(|w| *w == r[0])).count();
    // Until a replica has seen its peers' requests coincide with its own, it decides at once, as a
    // lone replica would, and all three requests of a round go to the idle engine.
    let learning = rounds_at_once(&all, 12, gap, "learning").await;
    for r in &replicas {
        let v = r.get("/admin/replicas").await;
        let c = &v["concurrency"];
        assert_eq!(c["in_step"], true, "three requests an instant, five instants a second: {v}");
        assert!(c["coinciding"].as_f64().unwrap() >= 0.5, "{v}");
    }
    let in_step = rounds_at_once(&all, 16, gap, "in step").await;
    eprintln!(
        "rounds with all three requests on one engine: {} of 12 while learning, {} of 16 in step\nlearning: {learning:?}\nin step: {in_step:?}",
        herded(&learning),
        herded(&in_step)
    );
    let staggered: u64 = {
        let mut n = 0;
        for r in &replicas {
            let text = reqwest::get(format!("{}/metrics", r.url)).await.unwrap().text().await.unwrap();
            n += text
                .lines()
                .find_map(|l| l.strip_prefix("kvgate_replica_staggered_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .expect("kvgate_replica_staggered_total") as u64;
        }
        n
    };
    assert!(staggered >= 40, "the 48 requests in step were staggered: {staggered}");
    assert!(herded(&in_step) <= 4, "in step, a round seldom lands whole on one engine: {in_step:?}");
    drop(held);
}
