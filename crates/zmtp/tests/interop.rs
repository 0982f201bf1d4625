//! The bounded sockets against another ZMTP implementation (the `zeromq` crate, as the mock engine
//! uses it) and against raw TCP peers that lie about lengths.

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
    // The first frame and half the second arrive, then the rest 300 ms later.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(&peer_opening("PUB")).await.unwrap();
        let mut msg = vec![0x01, 5];
        msg.extend_from_slice(b"topic");
        msg.extend_from_slice(&long_header(600, false));
        msg.extend_from_slice(&[7; 600]);
        let (first, rest) = msg.split_at(7 + 9 + 100);
        s.write_all(first).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.write_all(rest).await.unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink).await;
    });
    let mut sub = SubSocket::connect(&endpoint, b"", Limits::default()).await.unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(100), sub.recv()).await.is_err(), "nothing whole yet");
    let got = tokio::time::timeout(Duration::from_secs(5), sub.recv()).await.unwrap().unwrap();
    assert_eq!(got, vec![Bytes::from_static(b"topic"), Bytes::from(vec![7u8; 600])]);
}
