//! ZMTP 3.0 framing over one TCP connection: greeting, READY handshake, bounded frames.

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::{Limits, SocketType, ZmtpError};

/// One message: its frames in order.
pub type Message = Vec<Bytes>;

const FLAG_MORE: u8 = 0b001;
const FLAG_LONG: u8 = 0b010;
const FLAG_COMMAND: u8 = 0b100;
/// Commands are small (READY carries a few properties); a larger one is refused outright.
const MAX_COMMAND_BYTES: u64 = 64 << 10;

/// A connection past its handshake, ready to send and receive messages.
///
/// Reading is cancel-safe: bytes read but not yet a whole message stay in the connection, so a
/// [`Connection::recv`] dropped by a `select!` or a timeout loses nothing.
#[derive(Debug)]
pub struct Connection {
    reader: OwnedReadHalf,
    /// Bytes received and not yet decoded. It grows only with what the peer really sent.
    buf: BytesMut,
    /// Frames of the message being received.
    partial: Vec<Bytes>,
    partial_bytes: u64,
    writer: OwnedWriteHalf,
    limits: Limits,
    peer_type: String,
}

struct Frame {
    flags: u8,
    body: Bytes,
}

/// Most bytes asked of the socket in one read.
const READ_CHUNK: usize = 64 << 10;

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; // version 3.0
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn check_greeting(g: &[u8; 64]) -> Result<(), ZmtpError> {
    if g[0] != 0xff || g[9] != 0x7f {
        return Err(ZmtpError::Greeting("not a ZMTP 3 signature".into()));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting(format!("ZMTP version {}.{} (3.0 or later needed)", g[10], g[11])));
    }
    let mechanism = &g[12..32];
    let name_len = mechanism.iter().position(|&b| b == 0).unwrap_or(mechanism.len());
    if &mechanism[..name_len] != b"NULL" {
        let name = String::from_utf8_lossy(&mechanism[..name_len]);
        return Err(ZmtpError::Greeting(format!("security mechanism `{name}` (only NULL is spoken)")));
    }
    Ok(())
}

/// A READY command body announcing `socket_type`.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    let (name, value) = ("Socket-Type", socket_type);
    body.push(name.len() as u8);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(&(value.len() as u32).to_be_bytes());
    body.extend_from_slice(value.as_bytes());
    body
}

/// The `Socket-Type` property of a READY command body.
fn parse_ready(body: &[u8]) -> Result<String, ZmtpError> {
    let bad = |why: &str| ZmtpError::Handshake(why.to_owned());
    let (&name_len, rest) = body.split_first().ok_or_else(|| bad("empty command"))?;
    let (name, mut props) = rest.split_at_checked(name_len as usize).ok_or_else(|| bad("truncated command name"))?;
    if name != b"READY" {
        return Err(bad(&format!("expected READY, got `{}`", String::from_utf8_lossy(name))));
    }
    let mut socket_type = None;
    while let Some((&len, rest)) = props.split_first() {
        let (key, rest) = rest.split_at_checked(len as usize).ok_or_else(|| bad("truncated property name"))?;
        let (value_len, rest) = rest.split_at_checked(4).ok_or_else(|| bad("truncated property length"))?;
        let value_len = u32::from_be_bytes([value_len[0], value_len[1], value_len[2], value_len[3]]) as usize;
        let (value, rest) = rest.split_at_checked(value_len).ok_or_else(|| bad("truncated property value"))?;
        if key.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(String::from_utf8_lossy(value).into_owned());
        }
        props = rest;
    }
    socket_type.ok_or_else(|| bad("READY without Socket-Type"))
}

/// What a ZMTP 3.0 peer with the NULL mechanism sends first, announcing `socket_type` (`"PUB"`,
/// `"ROUTER"`, ...): its greeting and its READY command. Tests and probes use it to impersonate an
/// engine, honest up to whatever they send next.
pub fn peer_opening(socket_type: &str) -> Vec<u8> {
    let mut out = greeting().to_vec();
    encode_frame(&mut out, FLAG_COMMAND, &ready(socket_type));
    out
}

fn encode_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// The next frame of `buf` if it is all buffered; its header is checked as soon as it is, so a
/// length past the limits is refused before its body is waited for.
fn decode_frame(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Frame>, ZmtpError> {
    let Some(&flags) = buf.first() else { return Ok(None) };
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::Framing(format!("reserved flag bits set ({flags:#04x})")));
    }
    let header = if flags & FLAG_LONG != 0 { 9 } else { 2 };
    if buf.len() < header {
        return Ok(None);
    }
    let len = if flags & FLAG_LONG != 0 {
        u64::from_be_bytes(buf[1..9].try_into().expect("eight bytes"))
    } else {
        u64::from(buf[1])
    };
    let limit = if flags & FLAG_COMMAND != 0 { MAX_COMMAND_BYTES } else { limits.max_frame_bytes };
    if len > limit {
        return Err(ZmtpError::FrameTooLarge { announced: len, limit });
    }
    // Within the limit, so it fits in memory and in usize.
    let whole = header + len as usize;
    if buf.len() < whole {
        return Ok(None);
    }
    buf.advance(header);
    Ok(Some(Frame { flags, body: buf.split_to(len as usize).freeze() }))
}

/// The socket type of the peer's READY command `frame`, if `socket` can talk to it.
fn check_peer_ready(frame: &Frame, socket: SocketType) -> Result<String, ZmtpError> {
    if frame.flags & FLAG_COMMAND == 0 {
        return Err(ZmtpError::Handshake("a message before READY".into()));
    }
    let peer = parse_ready(&frame.body)?;
    if !socket.accepts(&peer) {
        return Err(ZmtpError::Handshake(format!("a {peer} socket cannot talk to {}", socket.as_str())));
    }
    Ok(peer)
}

/// Adds `frame` to the message being received (`partial`, `partial_bytes` so far): the whole
/// message once its last frame is in. Commands between messages are skipped (a 3.0 peer sends
/// none after READY; a newer one may send PING).
fn assemble(
    partial: &mut Vec<Bytes>,
    partial_bytes: &mut u64,
    frame: Frame,
    limits: &Limits,
) -> Result<Option<Message>, ZmtpError> {
    if frame.flags & FLAG_COMMAND != 0 {
        if !partial.is_empty() {
            return Err(ZmtpError::Framing("a command inside a multi-part message".into()));
        }
        return Ok(None);
    }
    *partial_bytes += frame.body.len() as u64;
    if *partial_bytes > limits.max_message_bytes {
        return Err(ZmtpError::MessageTooLarge(format!("over {} bytes in one message", limits.max_message_bytes)));
    }
    if partial.len() >= limits.max_frames {
        return Err(ZmtpError::MessageTooLarge(format!("over {} frames in one message", limits.max_frames)));
    }
    partial.push(frame.body);
    if frame.flags & FLAG_MORE == 0 {
        *partial_bytes = 0;
        return Ok(Some(std::mem::take(partial)));
    }
    Ok(None)
}

/// Reads what a peer sent on a connection, all of it in `bytes`, the way [`Connection`] reads it:
/// greeting, READY, then messages until the bytes run out or one is refused. For the fuzz targets
/// (`fuzz/`), which cannot open a socket per input.
#[cfg(fuzzing)]
pub fn fuzz_peer_bytes(bytes: &[u8], socket: SocketType, limits: &Limits) -> Result<Vec<Message>, ZmtpError> {
    let mut buf = BytesMut::from(bytes);
    if buf.len() < 64 {
        return Err(ZmtpError::Closed);
    }
    take_greeting(&mut buf)?;
    let frame = decode_frame(&mut buf, limits)?.ok_or(ZmtpError::Closed)?;
    check_peer_ready(&frame, socket)?;
    let (mut partial, mut partial_bytes, mut messages) = (Vec::new(), 0, Vec::new());
    while let Some(frame) = decode_frame(&mut buf, limits)? {
        messages.extend(assemble(&mut partial, &mut partial_bytes, frame, limits)?);
    }
    Ok(messages)
}

/// Takes the peer's 64-byte greeting off the front of `buf` (which holds at least 64 bytes) and
/// checks it.
fn take_greeting(buf: &mut BytesMut) -> Result<(), ZmtpError> {
    let mut theirs = [0u8; 64];
    theirs.copy_from_slice(&buf[..64]);
    buf.advance(64);
    check_greeting(&theirs)
}

impl Connection {
    /// Greets the peer on `stream` and exchanges READY commands as a `socket` socket, within
    /// [`Limits::handshake_timeout`].
    pub async fn handshake(stream: TcpStream, socket: SocketType, limits: Limits) -> Result<Connection, ZmtpError> {
        // Messages are small and latency matters more than packet count.
        let _ = stream.set_nodelay(true);
        let (read, writer) = stream.into_split();
        let mut conn = Connection {
            reader: read,
            buf: BytesMut::new(),
            partial: Vec::new(),
            partial_bytes: 0,
            writer,
            limits,
            peer_type: String::new(),
        };
        let handshake = async {
            conn.writer.write_all(&greeting()).await?;
            conn.fill(64).await?;
            take_greeting(&mut conn.buf)?;
            let mut out = Vec::new();
            encode_frame(&mut out, FLAG_COMMAND, &ready(socket.as_str()));
            conn.writer.write_all(&out).await?;
            let frame = conn.read_frame().await?;
            conn.peer_type = check_peer_ready(&frame, socket)?;
            Ok(())
        };
        match tokio::time::timeout(limits.handshake_timeout, handshake).await {
            Ok(Ok(())) => Ok(conn),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ZmtpError::HandshakeTimeout(limits.handshake_timeout)),
        }
    }

    /// The socket type the peer announced.
    pub fn peer_type(&self) -> &str {
        &self.peer_type
    }

    /// Reads until at least `n` bytes are buffered. Cancel-safe: what was read stays buffered.
    async fn fill(&mut self, n: usize) -> Result<(), ZmtpError> {
        while self.buf.len() < n {
            self.buf.reserve((n - self.buf.len()).min(READ_CHUNK));
            if self.reader.read_buf(&mut self.buf).await? == 0 {
                return Err(ZmtpError::Closed);
            }
        }
        Ok(())
    }

    /// The next frame, reading as needed (cancel-safe).
    async fn read_frame(&mut self) -> Result<Frame, ZmtpError> {
        loop {
            if let Some(frame) = decode_frame(&mut self.buf, &self.limits)? {
                return Ok(frame);
            }
            self.buf.reserve(READ_CHUNK.min(self.limits.max_frame_bytes as usize + 9));
            if self.reader.read_buf(&mut self.buf).await? == 0 {
                return Err(ZmtpError::Closed);
            }
        }
    }

    /// The next message, skipping the commands between messages (a 3.0 peer sends none after READY;
    /// a newer one may send PING). Cancel-safe: a message half received when the future is dropped
    /// is completed by the next call.
    pub async fn recv(&mut self) -> Result<Message, ZmtpError> {
        loop {
            let frame = self.read_frame().await?;
            if let Some(message) = assemble(&mut self.partial, &mut self.partial_bytes, frame, &self.limits)? {
                return Ok(message);
            }
        }
    }

    /// Sends one message made of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            encode_frame(&mut out, more, f);
        }
        self.writer.write_all(&out).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_round_trips_and_rejects_truncation() {
        let body = ready(SocketType::Sub.as_str());
        assert_eq!(parse_ready(&body).unwrap(), "SUB");
        for cut in 0..body.len() {
            assert!(parse_ready(&body[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn greetings_other_than_zmtp3_null_are_refused() {
        assert!(check_greeting(&greeting()).is_ok());
        let mut plain = greeting();
        plain[12..17].copy_from_slice(b"PLAIN");
        assert!(matches!(check_greeting(&plain), Err(ZmtpError::Greeting(m)) if m.contains("PLAIN")));
        let mut old = greeting();
        old[10] = 2;
        assert!(check_greeting(&old).is_err());
        assert!(check_greeting(&[0u8; 64]).is_err());
    }

    #[test]
    fn frames_use_the_long_form_past_255_bytes() {
        let mut out = Vec::new();
        encode_frame(&mut out, FLAG_MORE, &[7; 255]);
        assert_eq!(&out[..2], &[FLAG_MORE, 255]);
        out.clear();
        encode_frame(&mut out, 0, &[7; 256]);
        assert_eq!(out[0], FLAG_LONG);
        assert_eq!(u64::from_be_bytes(out[1..9].try_into().unwrap()), 256);
    }
}
