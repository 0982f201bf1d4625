//! What the black-box tests of the `kvgate` binary share.

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::time::Duration;

/// The address a `kvgate serve --log-format json` child logs in its "kvgate listening" line (its
/// stderr must be piped); the rest of stderr is drained so the child never blocks on it.
pub fn listening_address(child: &mut Child) -> String {
    let stderr = child.stderr.take().expect("stderr is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if v["message"] == "kvgate listening" {
                    let _ = tx.send(v["address"].as_str().unwrap_or_default().to_owned());
                }
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("kvgate logged its address")
}
