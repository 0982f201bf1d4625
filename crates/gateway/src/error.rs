//! Errors at the HTTP edge: each is classified by where it came from and whether a retry may help,
//! and mapped to a status code and an OpenAI-style body in exactly one place ([`ApiError::status`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Where an error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The client sent something wrong.
    Client,
    /// An engine failed.
    Upstream,
    /// The gateway itself (capacity, configuration, bugs).
    Gateway,
}

/// A request-level error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON.
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(String),
    /// The JSON is not a valid request.
    #[error("{message}")]
    InvalidRequest {
        /// The offending field.
        param: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// Missing or wrong API key.
    #[error("invalid or missing API key")]
    Unauthorized,
    /// No engine serves the model.
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// Unknown route or resource.
    #[error("{0}")]
    NotFound(String),
    /// The body is larger than allowed.
    #[error("the request body exceeds the limit of {0} bytes")]
    PayloadTooLarge(usize),
    /// The client took too long to send its body.
    #[error("the request body did not arrive within {0:.0} s")]
    BodyTimeout(f64),
    /// The prompt holds more tokens than any engine's KV cache.
    #[error("the prompt has {tokens} tokens; the largest engine holds {limit} tokens of KV cache")]
    PromptTooLong {
        /// Prompt tokens.
        tokens: u64,
        /// The largest engine's KV capacity in tokens.
        limit: u64,
    },
    /// Admission refused: every eligible engine's projected wait is over the bound.
    #[error("all engines are busy: the best projected wait is {wait_s:.1} s (limit {limit_s:.1} s); retry later")]
    Overloaded {
        /// The chosen engine's projected wait.
        wait_s: f64,
        /// The configured bound.
        limit_s: f64,
    },
    /// No engine is eligible (all unhealthy, draining or removed).
    #[error("no engine is available to serve the request")]
    NoEligibleWorker,
    /// Engines could not be reached.
    #[error("the upstream engine could not be reached")]
    UpstreamUnavailable,
    /// An engine did not answer in time.
    #[error("the upstream engine timed out")]
    UpstreamTimeout,
    /// An engine answered with a server error or broke the connection.
    #[error("the upstream engine failed")]
    UpstreamFailed,
    /// The gateway ran out of its own resources (file descriptors, ports, buffered body bytes).
    #[error("the gateway is short of {0}; retry later")]
    LocalResources(String),
    /// A bug or an impossible state.
    #[error("internal error")]
    Internal,
}

impl ApiError {
    /// An invalid request, naming the field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { param: Some(param.to_owned()), message: message.into() }
    }

    /// Where it came from.
    pub fn origin(&self) -> Origin {
        match self {
            ApiError::InvalidJson(_)
            | ApiError::InvalidRequest { .. }
            | ApiError::Unauthorized
            | ApiError::ModelNotFound(_)
            | ApiError::NotFound(_)
            | ApiError::PayloadTooLarge(_)
            | ApiError::BodyTimeout(_)
            | ApiError::PromptTooLong { .. } => Origin::Client,
            ApiError::UpstreamUnavailable | ApiError::UpstreamTimeout | ApiError::UpstreamFailed => Origin::Upstream,
            ApiError::Overloaded { .. }
            | ApiError::NoEligibleWorker
            | ApiError::LocalResources(_)
            | ApiError::Internal => Origin::Gateway,
        }
    }

    /// Whether the same request may succeed later.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            ApiError::Overloaded { .. }
                | ApiError::NoEligibleWorker
                | ApiError::LocalResources(_)
                | ApiError::UpstreamUnavailable
                | ApiError::UpstreamTimeout
        )
    }

    /// The one mapping from error to status code.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_) | ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::PromptTooLong { .. } => StatusCode::BAD_REQUEST,
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NoEligibleWorker | ApiError::LocalResources(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::UpstreamUnavailable | ApiError::UpstreamFailed => StatusCode::BAD_GATEWAY,
            ApiError::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `type` and `code` fields.
    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::InvalidJson(_) => ("invalid_request_error", "invalid_json"),
            ApiError::InvalidRequest { .. } => ("invalid_request_error", "invalid_value"),
            ApiError::Unauthorized => ("invalid_request_error", "invalid_api_key"),
            ApiError::ModelNotFound(_) => ("invalid_request_error", "model_not_found"),
            ApiError::NotFound(_) => ("invalid_request_error", "not_found"),
            ApiError::PayloadTooLarge(_) => ("invalid_request_error", "payload_too_large"),
            ApiError::BodyTimeout(_) => ("invalid_request_error", "body_timeout"),
            ApiError::PromptTooLong { .. } => ("invalid_request_error", "context_length_exceeded"),
            ApiError::Overloaded { .. } => ("server_error", "overloaded"),
            ApiError::NoEligibleWorker => ("server_error", "no_engine_available"),
            ApiError::LocalResources(_) => ("server_error", "gateway_out_of_resources"),
            ApiError::UpstreamUnavailable => ("server_error", "upstream_unavailable"),
            ApiError::UpstreamTimeout => ("server_error", "upstream_timeout"),
            ApiError::UpstreamFailed => ("server_error", "upstream_error"),
            ApiError::Internal => ("server_error", "internal_error"),
        }
    }

    /// The body, as OpenAI shapes it.
    pub fn body(&self) -> serde_json::Value {
        let (kind, code) = self.kind();
        let param = match self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            ApiError::ModelNotFound(_) => Some("model".into()),
            _ => None,
        };
        json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}})
    }

    /// Short label for metrics.
    pub fn metric_label(&self) -> &'static str {
        self.kind().1
    }
}

impl From<kvgate_tokenizer::request::RequestError> for ApiError {
    fn from(e: kvgate_tokenizer::request::RequestError) -> Self {
        ApiError::InvalidRequest { param: e.param, message: e.message }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let ApiError::Overloaded { wait_s, limit_s } = self {
            let retry = (wait_s - limit_s).ceil().clamp(1.0, 3600.0) as u64;
            if let Ok(v) = HeaderValue::from_str(&retry.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

/// Whether an error is the gateway's own shortage (descriptors, ports, memory), which no engine
/// should be blamed for.
pub fn is_local_resource_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if matches!(io.kind(), std::io::ErrorKind::AddrNotAvailable | std::io::ErrorKind::OutOfMemory) {
                return true;
            }
            // EMFILE and ENFILE (the same numbers on Linux and macOS), ENOBUFS (Linux).
            if matches!(io.raw_os_error(), Some(23 | 24))
                || (cfg!(target_os = "linux") && io.raw_os_error() == Some(105))
            {
                return true;
            }
        }
        source = s.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_bodies_follow_openai_conventions() {
        let e = ApiError::invalid("messages", "`messages` must be a non-empty array");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["error"]["param"], "messages");
        assert_eq!(ApiError::ModelNotFound("x".into()).status(), StatusCode::NOT_FOUND);
        let o = ApiError::Overloaded { wait_s: 40.2, limit_s: 30.0 };
        let resp = o.clone().into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "11");
        assert!(o.retryable() && o.origin() == Origin::Gateway);
        assert_eq!(ApiError::UpstreamFailed.origin(), Origin::Upstream);
    }
}
