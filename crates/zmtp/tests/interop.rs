//! The bounded sockets against another ZMTP implementation (the `zeromq` crate) and against raw TCP
//! peers that lie about lengths.

use std::time::Duration;

use bytes::Bytes;
use kvgate_zmtp::{connect_dealer, peer_opening, Limits, SubSocket, ZmtpError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn message(frames: &[&'static [u8]]) -> ZmqMessage {
    ZmqMessage::try_from(frames.iter().map(|f| Bytes::from_static(f)).collect::<Vec<_>>()).unwrap()
}

/// A PUB drops what it publishes before the subscription reaches it: publish until one arrives.
async fn publish_until_received(publisher: &mut zeromq::PubSocket, sub: &mut SubSocket) -> Vec<Bytes> {
    for _ in 0..200 {
        publisher.send(message(&[b"kv-events", &[0, 0, 0, 0, 0, 0, 0, 7], &[0x93, 1, 2, 3]])).await.unwrap();
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(25), sub.recv()).await {
            return m.unwrap();
        }
    }
    panic!("nothing arrived in 5 s");
}

#[tokio::test]
async fn a_connecting_sub_receives_multipart_messages_from_a_zeromq_pub() {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut sub = SubSocket::connect(&endpoint, b"kv", Limits::default()).await.unwrap();
    let got = publish_until_received(&mut publisher, &mut sub).await;
    assert_eq!(
        got,
        vec![
            Bytes::from_static(b"kv-events"),
            Bytes::from(vec![0, 0, 0, 0, 0, 0, 0, 7]),
            Bytes::from(vec![0x93, 1, 2, 3])
        ]
    );
}

#[tokio::test]
async fn the_topic_filters_at_the_publisher() {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut sub = SubSocket::connect(&endpoint, b"kv", Limits::default()).await.unwrap();
    publish_until_received(&mut publisher, &mut sub).await;
    publisher.send(message(&[b"other", b"x"])).await.unwrap();
    publisher.send(message(&[b"kv-events", b"y"])).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), sub.recv()).await.unwrap().unwrap();
    assert_eq!(next[1], Bytes::from_static(b"y"));
}

#[tokio::test]
async fn a_binding_sub_receives_from_a_pub_that_connects() {
    let mut sub = SubSocket::bind("tcp://127.0.0.1:0", b"", Limits::default()).await.unwrap();
    let addr = sub.local_addr().unwrap();
    let mut publisher = zeromq::PubSocket::new();
    publisher.connect(&format!("tcp://{addr}")).await.unwrap();
    let got = publish_until_received(&mut publisher, &mut sub).await;
    assert_eq!(got[0], Bytes::from_static(b"kv-events"));
}

#[tokio::test]
async fn a_dealer_talks_to_a_zeromq_router() {
    let mut router = zeromq::RouterSocket::new();
    let endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    tokio::spawn(async move {
        let req = router.recv().await.unwrap().into_vec();
        assert_eq!(&req[1..], &[Bytes::new(), Bytes::from_static(b"from")]);
        let long = Bytes::from(vec![9u8; 1000]);
        router.send(ZmqMessage::try_from(vec![req[0].clone(), Bytes::new(), long]).unwrap()).await.unwrap();
    });
    let mut dealer = connect_dealer(&endpoint, Limits::default()).await.unwrap();
    assert_eq!(dealer.peer_type(), "ROUTER");
    dealer.send(&[b"", b"from"]).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(5), dealer.recv()).await.unwrap().unwrap();
    assert_eq!(reply, vec![Bytes::new(), Bytes::from(vec![9u8; 1000])]);
}

/// A raw peer that greets and shakes hands like a PUB, then sends `after` and waits.
async fn lying_publisher(after: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(&peer_opening("PUB")).await.unwrap();
        s.write_all(&after).await.unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink).await;
    });
    endpoint
}

fn long_header(len: u64, more: bool) -> Vec<u8> {
    let mut h = vec![0x02 | u8::from(more)];
    h.extend_from_slice(&len.to_be_bytes());
    h
}

#[tokio::test]
async fn a_frame_header_announcing_a_terabyte_is_an_error_not_an_allocation() {
    for announced in [1u64 << 40, 64 << 30, u64::MAX] {
        let endpoint = lying_publisher(long_header(announced, false)).await;
        let mut sub = SubSocket::connect(&endpoint, b"", Limits::default()).await.unwrap();
        let err = tokio::time::timeout(Duration::from_secs(5), sub.recv()).await.unwrap().unwrap_err();
        assert!(matches!(err, ZmtpError::FrameTooLarge { announced: a, .. } if a == announced), "{err}");
        assert!(err.is_protocol_violation());
    }
}

#[tokio::test]
async fn frames_under_the_limit_that_add_up_past_it_are_refused() {
    let limits = Limits { max_frame_bytes: 1000, max_message_bytes: 1500, ..Limits::default() };
    let mut bytes = long_header(1000, true);
    bytes.extend_from_slice(&[0; 1000]);
    bytes.extend_from_slice(&long_header(1000, false));
    bytes.extend_from_slice(&[0; 1000]);
    let endpoint = lying_publisher(bytes).await;
    let mut sub = SubSocket::connect(&endpoint, b"", limits).await.unwrap();
    let err = sub.recv().await.unwrap_err();
    assert!(matches!(err, ZmtpError::MessageTooLarge(_)), "{err}");
}

#[tokio::test]
async fn a_peer_that_sends_no_greeting_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let _held = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(s);
    });
    let limits = Limits { handshake_timeout: Duration::from_millis(200), ..Limits::default() };
    let err = SubSocket::connect(&endpoint, b"", limits).await.unwrap_err();
    assert!(matches!(err, ZmtpError::HandshakeTimeout(_)), "{err}");
}

#[tokio::test]
async fn a_binding_sub_drops_a_lying_peer_and_keeps_serving_the_others() {
    let mut sub = SubSocket::bind("tcp://127.0.0.1:0", b"", Limits::default()).await.unwrap();
    let addr = sub.local_addr().unwrap();
    // The liar: a valid greeting and READY, then a 1 TB frame header.
    let mut liar = tokio::net::TcpStream::connect(addr).await.unwrap();
    liar.write_all(&peer_opening("PUB")).await.unwrap();
    liar.write_all(&long_header(1 << 40, false)).await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), sub.recv()).await.unwrap().unwrap_err();
    assert!(err.is_peer() && err.is_protocol_violation(), "{err}");
    // An honest publisher still gets through.
    let mut publisher = zeromq::PubSocket::new();
    publisher.connect(&format!("tcp://{addr}")).await.unwrap();
    let got = publish_until_received(&mut publisher, &mut sub).await;
    assert_eq!(got[0], Bytes::from_static(b"kv-events"));
}

#[tokio::test]
async fn a_receive_cancelled_mid_message_loses_nothing() {
    // The first frame and half the second arrive; the rest only once the first receive was cancelled.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let (cancelled, rest_may_go) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(&peer_opening("PUB")).await.unwrap();
        let mut msg = vec![0x01, 5];
        msg.extend_from_slice(b"topic");
        msg.extend_from_slice(&long_header(600, false));
        msg.extend_from_slice(&[7; 600]);
        let (first, rest) = msg.split_at(7 + 9 + 100);
        s.write_all(first).await.unwrap();
        rest_may_go.await.unwrap();
        s.write_all(rest).await.unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink).await;
    });
    let mut sub = SubSocket::connect(&endpoint, b"", Limits::default()).await.unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(100), sub.recv()).await.is_err(), "nothing whole yet");
    cancelled.send(()).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), sub.recv()).await.unwrap().unwrap();
    assert_eq!(got, vec![Bytes::from_static(b"topic"), Bytes::from(vec![7u8; 600])]);
}

async fn until(what: &str, f: impl Fn() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

fn frames(parts: &[&'static [u8]]) -> Vec<Bytes> {
    parts.iter().map(|p| Bytes::from_static(p)).collect()
}

#[tokio::test]
async fn a_pub_counts_a_subscriber_once_its_subscription_arrived_and_then_loses_nothing() {
    let publisher = kvgate_zmtp::PubSocket::bind("tcp://127.0.0.1:0", Limits::default()).await.unwrap();
    assert_eq!(publisher.subscribers(), 0);
    assert_eq!(publisher.send(frames(&[b"kv-events", b"lost"])), 0, "nobody listens yet");
    let mut sub = SubSocket::connect(&publisher.endpoint(), b"kv", Limits::default()).await.unwrap();
    until("the subscription", || publisher.subscribers() == 1).await;
    // No retry loop: the count is the readiness probe.
    assert_eq!(publisher.send(frames(&[b"other", b"filtered"])), 0);
    assert_eq!(publisher.send(frames(&[b"kv-events", b"1"])), 1);
    let got = tokio::time::timeout(Duration::from_secs(5), sub.recv()).await.unwrap().unwrap();
    assert_eq!(got, frames(&[b"kv-events", b"1"]));
    drop(sub);
    until("the subscriber gone", || publisher.subscribers() == 0).await;
}

#[tokio::test]
async fn a_zeromq_sub_subscribes_to_the_pub_and_a_slow_one_never_blocks_it() {
    let publisher = kvgate_zmtp::PubSocket::bind("tcp://127.0.0.1:0", Limits::default()).await.unwrap();
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&publisher.endpoint()).await.unwrap();
    sub.subscribe("").await.unwrap();
    until("the zeromq subscription", || publisher.subscribers() == 1).await;
    // Far more than the high-water mark, never read meanwhile: sending returns at once each time.
    for i in 0..5000u32 {
        publisher.send(vec![Bytes::from_static(b"t"), Bytes::from(i.to_be_bytes().to_vec())]);
    }
    let first = tokio::time::timeout(Duration::from_secs(5), sub.recv()).await.unwrap().unwrap().into_vec();
    assert_eq!(first, vec![Bytes::from_static(b"t"), Bytes::from(0u32.to_be_bytes().to_vec())]);
}

#[tokio::test]
async fn a_pub_refuses_a_peer_that_is_not_a_subscriber() {
    let publisher = kvgate_zmtp::PubSocket::bind("tcp://127.0.0.1:0", Limits::default()).await.unwrap();
    let mut raw = tokio::net::TcpStream::connect(publisher.local_addr()).await.unwrap();
    raw.write_all(&peer_opening("PUB")).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let mut seen = 0;
    // The publisher answers the greeting, then closes on the incompatible READY.
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), raw.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        seen += n;
    }
    assert!(seen >= 64, "it greeted first");
    assert_eq!(publisher.subscribers(), 0);
}
