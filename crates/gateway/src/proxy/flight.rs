//! A request's life on one engine: its reservation and in-flight accounting, whichever backend
//! carries it.

use std::sync::Arc;
use std::time::Instant;

use kvgate_core::RequestId;

use crate::engines;
use crate::error::ApiError;
use crate::registry::EngineHandle;
use crate::state::AppState;

/// How a flight ended, for the request counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The client went away before the response was complete (499, nginx's convention).
    ClientGone,
    /// The response ended with this status.
    Status(u16),
    /// Not counted here: the request goes on to another engine, or [`dispatch`] counts it.
    Retried,
}

/// A request's reservation and in-flight accounting on one engine, released when the response is
/// done with: at the last byte, on an upstream error, or when the client goes away and the body is
/// dropped.
pub(super) struct Flight {
    /// The gateway's state.
    pub(super) state: Arc<AppState>,
    /// The reservation's request id.
    pub(super) id: RequestId,
    /// The engine the request was placed on.
    pub(super) engine: Arc<EngineHandle>,
    started: Instant,
    first_byte: bool,
    /// How the flight ends; counted when it is dropped.
    pub(super) outcome: Outcome,
    /// Tokens the response says it generated (a streamed `usage` chunk), for decode calibration.
    pub(super) output_tokens: Option<u64>,
}

impl Flight {
    pub(super) fn new(state: &Arc<AppState>, id: RequestId, engine: Arc<EngineHandle>) -> Flight {
        engine.metrics.in_flight.inc();
        Flight {
            state: state.clone(),
            id,
            engine,
            started: state.clock.instant(),
            first_byte: false,
            outcome: Outcome::ClientGone,
            output_tokens: None,
        }
    }

    /// The response's first bytes arrived. A stream's first bytes are its first token, which moves
    /// the reservation to decode and times the prefill; a body that does not stream arrives whole,
    /// so its time says nothing about the prefill and the reservation is simply released at the end.
    pub(super) fn first_byte(&mut self, streamed: bool) {
        if !self.first_byte {
            self.first_byte = true;
            if streamed {
                let _ = self.state.router.first_token(self.id, self.state.clock.now());
            }
            self.engine.metrics.ttft.observe(self.started.elapsed().as_secs_f64());
        }
    }

    /// The engine failed this request: count it against the engine and end with `err`'s status.
    pub(super) fn engine_failed(&mut self, err: &ApiError) {
        engines::request_failed(&self.state.engine_context(), &self.engine);
        self.outcome = Outcome::Status(err.status().as_u16());
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let _ = self.state.router.release_with_output(self.id, self.state.clock.now(), self.output_tokens);
        self.state.capacity.notify_one();
        let m = &self.engine.metrics;
        m.in_flight.dec();
        m.duration.observe(self.started.elapsed().as_secs_f64());
        match self.outcome {
            Outcome::Status(200) => {
                m.ok.inc();
            }
            Outcome::Status(s) => self.state.metrics.request(s, Some(self.engine.id.as_str())),
            Outcome::ClientGone => self.state.metrics.request(499, Some(self.engine.id.as_str())),
            Outcome::Retried => {}
        }
    }
}

/// What to write before an error event so that it stands alone: a stream cut mid-line or mid-event
/// would otherwise glue the error onto the engine's partial output.
pub(super) fn event_separator(sent_tail: &[u8]) -> &'static str {
    if sent_tail.is_empty() || sent_tail.ends_with(b"\n\n") {
        ""
    } else if sent_tail.ends_with(b"\n") {
        "\n"
    } else {
        "\n\n"
    }
}

/// The error event that ends a stream the engine broke off, after `sent_tail`, the last bytes the
/// client was sent.
pub(super) fn error_event(sent_tail: &[u8], failure: &ApiError) -> String {
    format!("{}data: {}\n\n", event_separator(sent_tail), failure.body())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_event_never_continues_a_partial_line() {
        assert_eq!(event_separator(b""), "");
        assert_eq!(event_separator(b"}\n\n"), "");
        assert_eq!(event_separator(b"}\n"), "\n");
        assert_eq!(event_separator(b"{\"cho"), "\n\n");
        assert!(error_event(b"{\"cho", &ApiError::UpstreamFailed).starts_with("\n\ndata: {"));
    }
}
