//! `tcp://HOST:PORT` endpoints as ZeroMQ writes them.

use std::net::SocketAddr;

use crate::ZmtpError;

/// A parsed `tcp://HOST:PORT` endpoint. `*` as the host means every interface (binding only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    host: String,
    port: u16,
}

impl Endpoint {
    /// Parses `tcp://HOST:PORT` (`HOST` a name, an IPv4 address, `[IPv6]` or `*`).
    pub fn parse(endpoint: &str) -> Result<Endpoint, ZmtpError> {
        let bad = |why: &str| ZmtpError::Endpoint { endpoint: endpoint.to_owned(), why: why.to_owned() };
        let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| bad("only tcp://HOST:PORT is supported"))?;
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no :PORT"))?;
        let port = port.parse::<u16>().map_err(|_| bad("the port is not a number from 0 to 65535"))?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Endpoint { host: host.to_owned(), port })
    }

    /// The address to connect to or bind (the first the host resolves to; `*` is `0.0.0.0`).
    pub async fn resolve(&self) -> Result<SocketAddr, ZmtpError> {
        let host = if self.host == "*" { "0.0.0.0" } else { self.host.as_str() };
        let mut addrs = tokio::net::lookup_host((host, self.port)).await?;
        addrs.next().ok_or_else(|| ZmtpError::Endpoint {
            endpoint: format!("tcp://{}:{}", self.host, self.port),
            why: "the host resolves to no address".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_engines_use() {
        assert_eq!(Endpoint::parse("tcp://127.0.0.1:5557").unwrap(), Endpoint { host: "127.0.0.1".into(), port: 5557 });
        assert_eq!(Endpoint::parse("tcp://*:5557").unwrap().host, "*");
        assert_eq!(Endpoint::parse("tcp://[::1]:5557").unwrap().host, "::1");
        assert_eq!(Endpoint::parse("tcp://engine-3:0").unwrap().port, 0);
        for bad in ["ipc:///tmp/x", "tcp://host", "tcp://:5557", "tcp://h:99999", "tcp://h:x"] {
            assert!(matches!(Endpoint::parse(bad), Err(ZmtpError::Endpoint { .. })), "{bad}");
        }
    }
}
