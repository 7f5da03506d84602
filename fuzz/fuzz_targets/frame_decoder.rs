//! Fuzzes the data plane's frame decoder: whole-buffer and incremental decoding of arbitrary
//! bytes must give a frame or a typed error, never a panic (FRAME-5), and an accepted frame
//! must re-encode to the bytes it came from.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwork::cluster::frame::{self, FrameDecoder};

/// Small, so the fuzzer also reaches the over-the-maximum path.
const MAX_PAYLOAD: u64 = 4096;

fuzz_target!(|data: &[u8]| {
    if let Ok((frame, used)) = frame::decode(data, MAX_PAYLOAD) {
        assert_eq!(
            frame::encode(frame.kind, frame.seq, &frame.payload),
            &data[..used]
        );
    }
    // The same bytes fed in pieces whose sizes come from the first byte.
    let piece = usize::from(data.first().copied().unwrap_or(1).max(1));
    let mut decoder = FrameDecoder::new(MAX_PAYLOAD);
    for chunk in data.chunks(piece) {
        decoder.extend(chunk);
        loop {
            match decoder.next_frame() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = decoder.finish();
});
