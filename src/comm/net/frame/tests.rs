use proptest::prelude::*;

use super::*;

const MAX: u64 = 1 << 16;

fn kind() -> impl Strategy<Value = FrameKind> {
    proptest::sample::select(FrameKind::ALL.to_vec())
}

fn payload() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..512)
}

#[test]
fn header_is_fixed_length_and_starts_with_magic_and_version() {
    let header = encode_header(FrameKind::Data, 7, b"abc");
    assert_eq!(header.len(), HEADER_LEN);
    assert_eq!(&header[..4], &MAGIC);
    assert_eq!(u16::from_le_bytes([header[4], header[5]]), PROTOCOL_VERSION);
}

#[test]
fn frame_2_oversize_length_is_rejected_from_the_header_alone() {
    let mut header = encode_header(FrameKind::Data, 0, &[]);
    // Declare 1 TiB and fix up the header crc, so only the length is wrong.
    header[15..23].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let crc = crc32fast::hash(&header[..HEADER_CRC_OFFSET]);
    header[HEADER_CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(
        decode_header(&header, MAX),
        Err(FrameError::TooLarge {
            declared: 1 << 40,
            max: MAX
        })
    );
    // decode sees only the header: no payload follows, yet the answer is TooLarge.
    assert!(matches!(
        decode(&header, MAX),
        Err(FrameError::TooLarge { .. })
    ));
}

#[test]
fn frame_6_other_version_is_named_as_such() {
    let mut bytes = encode(FrameKind::Data, 1, b"x");
    bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
    assert_eq!(
        decode(&bytes, MAX).map(|_| ()),
        Err(FrameError::UnsupportedVersion {
            found: 2,
            supported: PROTOCOL_VERSION
        })
    );
}

#[test]
fn unknown_kind_with_valid_header_crc_is_rejected() {
    let mut header = encode_header(FrameKind::Data, 0, &[]);
    header[6] = 200;
    let crc = crc32fast::hash(&header[..HEADER_CRC_OFFSET]);
    header[HEADER_CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(
        decode_header(&header, MAX),
        Err(FrameError::UnknownKind(200))
    );
}

#[test]
fn f32_payload_is_little_endian_bytes() {
    let values = [1.0f32, -0.0, f32::NAN, f32::MIN_POSITIVE, 3.5e-42];
    let mut bytes = Vec::new();
    put_f32s(&values, &mut bytes);
    assert_eq!(bytes.len(), values.len() * 4);
    assert_eq!(&bytes[..4], &1.0f32.to_le_bytes());
    let mut back = [0f32; 5];
    get_f32s(&bytes, &mut back).unwrap();
    assert!(
        values
            .iter()
            .zip(&back)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    assert!(matches!(
        get_f32s(&bytes[1..], &mut back),
        Err(FrameError::PayloadLength { bytes: 19, .. })
    ));
}

#[test]
fn decoder_finish_reports_a_partial_frame() {
    let bytes = encode(FrameKind::Data, 3, b"hello");
    let mut decoder = FrameDecoder::new(MAX);
    decoder.extend(&bytes[..bytes.len() - 1]);
    assert_eq!(decoder.next_frame(), Ok(None));
    assert_eq!(
        decoder.finish(),
        Err(FrameError::Truncated {
            expected: bytes.len() as u64,
            got: bytes.len() as u64 - 1
        })
    );
}

proptest! {
    /// FRAME-1.
    #[test]
    fn frame_1_encode_then_decode_round_trips(kind in kind(), seq in any::<u64>(), payload in payload()) {
        let bytes = encode(kind, seq, &payload);
        prop_assert_eq!(bytes.len(), HEADER_LEN + payload.len());
        let (frame, used) = decode(&bytes, MAX).unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(frame, Frame { kind, seq, payload });
    }

    /// FRAME-1 for the incremental decoder, with the input cut into arbitrary pieces.
    #[test]
    fn frame_1_incremental_decoder_round_trips_a_stream(
        frames in proptest::collection::vec((kind(), any::<u64>(), payload()), 0..6),
        cut in 1usize..97,
    ) {
        let stream: Vec<u8> = frames.iter().flat_map(|(k, s, p)| encode(*k, *s, p)).collect();
        let mut decoder = FrameDecoder::new(MAX);
        let mut out = Vec::new();
        for piece in stream.chunks(cut) {
            decoder.extend(piece);
            while let Some(frame) = decoder.next_frame().unwrap() {
                out.push(frame);
            }
        }
        prop_assert!(decoder.finish().unwrap().is_empty());
        let expected: Vec<Frame> = frames
            .into_iter()
            .map(|(kind, seq, payload)| Frame { kind, seq, payload })
            .collect();
        prop_assert_eq!(out, expected);
    }

    /// FRAME-4: every proper prefix is an error, and for the incremental decoder never a frame.
    #[test]
    fn frame_4_any_truncation_is_an_error(kind in kind(), seq in any::<u64>(), payload in payload(), at in any::<prop::sample::Index>()) {
        let bytes = encode(kind, seq, &payload);
        let cut = at.index(bytes.len());
        let result = decode(&bytes[..cut], MAX);
        prop_assert!(matches!(result, Err(FrameError::Truncated { .. })), "{:?}", result);
        let mut decoder = FrameDecoder::new(MAX);
        decoder.extend(&bytes[..cut]);
        prop_assert_eq!(decoder.next_frame(), Ok(None));
        // An empty input is an empty stream, not a cut frame.
        prop_assert_eq!(decoder.finish().is_err(), cut > 0);
    }

    /// FRAME-3: any single changed byte, header or payload, is detected.
    #[test]
    fn frame_3_any_single_byte_corruption_is_an_error(
        kind in kind(),
        seq in any::<u64>(),
        payload in payload(),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let mut bytes = encode(kind, seq, &payload);
        let i = at.index(bytes.len());
        bytes[i] ^= flip;
        let result = decode(&bytes, MAX);
        prop_assert!(result.is_err(), "byte {} ^ {:#04x} accepted: {:?}", i, flip, result);
    }

    /// FRAME-5: arbitrary bytes give a frame or an error, never a panic; a frame that is
    /// accepted re-encodes to the same bytes.
    #[test]
    fn frame_5_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok((frame, used)) = decode(&bytes, MAX) {
            prop_assert_eq!(encode(frame.kind, frame.seq, &frame.payload), bytes[..used].to_vec());
        }
        let mut decoder = FrameDecoder::new(MAX);
        decoder.extend(&bytes);
        let _ = decoder.next_frame();
    }

    /// FRAME-5 with a valid-looking prefix, so the fuzzing reaches past the magic check.
    #[test]
    fn frame_5_arbitrary_tails_after_magic_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..128)) {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        bytes.extend_from_slice(&tail);
        let _ = decode(&bytes, MAX);
    }
}
