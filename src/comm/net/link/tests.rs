use std::thread;

use super::*;

fn token(byte: u8) -> JobToken {
    JobToken::from_bytes([byte; 32])
}

fn quick() -> LinkConfig {
    LinkConfig::default()
        .with_io_timeout(Duration::from_secs(5))
        .with_handshake_timeout(Duration::from_secs(5))
        .with_max_payload(32 << 20)
}

/// A listener for rank 0 on an ephemeral port of 127.0.0.1.
fn listener(config: LinkConfig) -> (LinkListener, SocketAddr) {
    let listener = LinkListener::bind("127.0.0.1:0", Rank(0), token(7), config).unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// Rank 0 accepts, rank 1 connects; both links are returned.
fn pair(config: LinkConfig) -> (Link, Link) {
    let (listener, addr) = listener(config);
    let connector = thread::spawn(move || Link::connect(addr, Rank(1), Rank(0), &token(7), config));
    let accepted = listener.accept().unwrap();
    (accepted, connector.join().unwrap().unwrap())
}

/// Sends raw bytes as if a peer that skipped the checks wrote them.
fn write_raw(link: &mut Link, bytes: &[u8]) {
    link.stream.write_all(bytes).unwrap();
}

#[test]
fn handshake_exchanges_ranks_and_data_flows_both_ways() {
    let (mut a, mut b) = pair(quick());
    assert_eq!((a.rank(), a.peer().rank), (Rank(0), Some(Rank(1))));
    assert_eq!((b.rank(), b.peer().rank), (Rank(1), Some(Rank(0))));
    a.send_frame(b"to one").unwrap();
    b.send_frame(b"to zero").unwrap();
    let mut buf = Vec::new();
    let header = b.recv_frame(&mut buf).unwrap();
    assert_eq!((header.seq, buf.as_slice()), (1, &b"to one"[..]));
    a.recv_frame(&mut buf).unwrap();
    assert_eq!(buf, b"to zero");
    a.close().unwrap();
    assert!(matches!(
        b.recv_frame(&mut buf),
        Err(LinkError::Closed { .. })
    ));
    assert!(matches!(
        b.recv_frame(&mut buf),
        Err(LinkError::Broken { .. })
    ));
}

#[test]
fn link_1_wrong_token_is_refused_on_both_sides() {
    let (listener, addr) = listener(quick());
    let connector =
        thread::spawn(move || Link::connect(addr, Rank(1), Rank(0), &token(8), quick()));
    let accepted = listener.accept();
    assert!(
        matches!(
            accepted,
            Err(LinkError::Rejected {
                reason: Rejection::WrongToken,
                ..
            })
        ),
        "{accepted:?}"
    );
    let connected = connector.join().unwrap();
    assert!(
        matches!(connected, Err(LinkError::HandshakeRefused { .. })),
        "{connected:?}"
    );
    // The listener still admits the right token afterwards.
    let good = thread::spawn(move || Link::connect(addr, Rank(2), Rank(0), &token(7), quick()));
    assert_eq!(listener.accept().unwrap().peer().rank, Some(Rank(2)));
    good.join().unwrap().unwrap();
}

#[test]
fn link_1_connection_without_hello_is_refused() {
    let (listener, addr) = listener(quick().with_handshake_timeout(Duration::from_millis(300)));
    // Garbage instead of a Hello.
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n")
        .unwrap();
    let accepted = listener.accept();
    assert!(
        matches!(
            accepted,
            Err(LinkError::Rejected {
                reason: Rejection::BadFrame(FrameError::BadMagic { .. }),
                ..
            })
        ),
        "{accepted:?}"
    );
    // Silence instead of a Hello.
    let _silent = TcpStream::connect(addr).unwrap();
    let accepted = listener.accept();
    assert!(
        matches!(
            accepted,
            Err(LinkError::Rejected {
                reason: Rejection::HelloTimeout,
                ..
            })
        ),
        "{accepted:?}"
    );
}

#[test]
fn link_1_connector_checks_the_rank_it_reaches() {
    let (listener, addr) = listener(quick());
    let connector =
        thread::spawn(move || Link::connect(addr, Rank(1), Rank(3), &token(7), quick()));
    let _accepted = listener.accept().unwrap();
    let connected = connector.join().unwrap();
    assert!(
        matches!(
            connected,
            Err(LinkError::WrongPeer {
                expected: Rank(3),
                found: Rank(0)
            })
        ),
        "{connected:?}"
    );
}

#[test]
fn link_3_oversize_frame_is_refused_without_allocating() {
    let config = quick().with_max_payload(1 << 20);
    let (mut a, mut b) = pair(config);
    // A header declaring 1 GiB; the payload never follows.
    let mut header = frame::encode_header(FrameKind::Data, 1, &[]);
    header[15..23].copy_from_slice(&(1u64 << 30).to_le_bytes());
    let crc = crc32fast::hash(&header[..HEADER_LEN - 4]);
    header[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
    write_raw(&mut a, &header);
    let mut buf = Vec::new();
    let received = b.recv_frame(&mut buf);
    assert!(
        matches!(
            received,
            Err(LinkError::Frame {
                source: FrameError::TooLarge {
                    declared: 1_073_741_824,
                    max: 1_048_576
                },
                ..
            })
        ),
        "{received:?}"
    );
    assert_eq!(
        buf.capacity(),
        0,
        "nothing was allocated for the declared length"
    );
    // LINK-4: the link is closed after it.
    assert!(matches!(
        b.recv_frame(&mut buf),
        Err(LinkError::Broken { .. })
    ));
    // And the sending side refuses to send over its maximum.
    let (mut a, _b) = pair(config);
    assert!(matches!(
        a.send_frame(&vec![0u8; (1 << 20) + 1]),
        Err(LinkError::PayloadTooLarge { .. })
    ));
}

#[test]
fn peer_closing_mid_frame_is_an_unexpected_eof() {
    let (mut a, mut b) = pair(quick());
    let payload = vec![5u8; 1000];
    let bytes = frame::encode(FrameKind::Data, 1, &payload);
    write_raw(&mut a, &bytes[..HEADER_LEN + 400]);
    drop(a);
    let mut buf = Vec::new();
    let received = b.recv_frame(&mut buf);
    assert!(
        matches!(
            received,
            Err(LinkError::UnexpectedEof {
                awaiting: Awaiting::Payload { seq: 1 },
                got: 400,
                expected: 1000,
                ..
            })
        ),
        "{received:?}"
    );
    // Inside the header too.
    let (mut a, mut b) = pair(quick());
    write_raw(&mut a, &bytes[..10]);
    drop(a);
    let received = b.recv_frame(&mut buf);
    assert!(
        matches!(
            received,
            Err(LinkError::UnexpectedEof {
                awaiting: Awaiting::Header,
                got: 10,
                ..
            })
        ),
        "{received:?}"
    );
}

#[test]
fn corrupted_payload_is_rejected_and_closes_the_link() {
    let (mut a, mut b) = pair(quick());
    let mut bytes = frame::encode(FrameKind::Data, 1, b"0123456789");
    bytes[HEADER_LEN + 3] ^= 1;
    write_raw(&mut a, &bytes);
    let received = b.recv_frame(&mut Vec::new());
    assert!(
        matches!(
            received,
            Err(LinkError::Frame {
                source: FrameError::PayloadChecksum { seq: 1, .. },
                ..
            })
        ),
        "{received:?}"
    );
}

#[test]
fn out_of_order_frame_is_rejected() {
    let (mut a, mut b) = pair(quick());
    write_raw(&mut a, &frame::encode(FrameKind::Data, 5, b"x"));
    let received = b.recv_frame(&mut Vec::new());
    assert!(
        matches!(
            received,
            Err(LinkError::OutOfSequence {
                expected: 1,
                found: 5,
                ..
            })
        ),
        "{received:?}"
    );
}

#[test]
fn link_2_silent_peer_times_out_within_the_bound() {
    let bound = Duration::from_millis(300);
    let (_a, mut b) = pair(quick().with_io_timeout(bound));
    let started = Instant::now();
    let received = b.recv_frame(&mut Vec::new());
    let took = started.elapsed();
    assert!(
        matches!(
            received,
            Err(LinkError::Timeout {
                peer: Peer {
                    rank: Some(Rank(0)),
                    ..
                },
                awaiting: Awaiting::Header,
                after,
            }) if after == bound
        ),
        "{received:?}"
    );
    // The upper bound only guards against a hang; it has slack for a loaded machine.
    assert!(
        took >= bound && took < bound + Duration::from_secs(5),
        "took {took:?}"
    );
}

#[test]
fn link_2_trickling_peer_cannot_stretch_the_bound() {
    let bound = Duration::from_millis(400);
    let (mut a, mut b) = pair(quick().with_io_timeout(bound));
    // 95 bytes, one every 150 ms: the frame would take 14 s, each byte well inside the bound.
    let bytes = frame::encode(FrameKind::Data, 1, &[1u8; 64]);
    let trickle = thread::spawn(move || {
        for byte in bytes {
            if a.stream.write_all(&[byte]).is_err() {
                break;
            }
            thread::sleep(Duration::from_millis(150));
        }
    });
    let started = Instant::now();
    let received = b.recv_frame(&mut Vec::new());
    let took = started.elapsed();
    assert!(
        matches!(received, Err(LinkError::Timeout { .. })),
        "{received:?}"
    );
    // Ended by the bound, not by the 14 s frame (slack for a loaded machine).
    assert!(took < bound + Duration::from_secs(5), "took {took:?}");
    drop(b);
    trickle.join().unwrap();
}

#[test]
fn link_2_accept_without_a_peer_times_out() {
    let (listener, _addr) = listener(quick().with_handshake_timeout(Duration::from_millis(100)));
    assert!(matches!(
        listener.accept(),
        Err(LinkError::Timeout {
            awaiting: Awaiting::Accept,
            ..
        })
    ));
}

#[test]
fn link_5_sixteen_mib_round_trips_bit_exactly() {
    let (mut a, mut b) = pair(quick());
    let values: Vec<f32> = (0..(4 << 20))
        .map(|i: u32| f32::from_bits(i.wrapping_mul(2_654_435_761)))
        .collect();
    let mut bytes = Vec::new();
    frame::put_f32s(&values, &mut bytes);
    assert_eq!(bytes.len(), 16 << 20);
    let echo = thread::spawn(move || {
        let mut buf = Vec::new();
        b.recv_frame(&mut buf).unwrap();
        b.send_frame(&buf).unwrap();
    });
    a.send_frame(&bytes).unwrap();
    let mut back = Vec::new();
    a.recv_frame(&mut back).unwrap();
    echo.join().unwrap();
    let mut decoded = vec![0f32; values.len()];
    frame::get_f32s(&back, &mut decoded).unwrap();
    assert!(
        values
            .iter()
            .zip(&decoded)
            .all(|(x, y)| x.to_bits() == y.to_bits())
    );
}

#[test]
fn token_debug_hides_the_bytes() {
    assert_eq!(format!("{:?}", token(0xab)), "JobToken(..)");
    assert_ne!(JobToken::random(), JobToken::random());
}
