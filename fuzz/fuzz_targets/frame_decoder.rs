//! Fuzzes the data plane's frame decoder: whole-buffer and incremental decoding of arbitrary
//! bytes must give a frame or a typed error, never a panic (FRAME-5), and an accepted frame
//! must re-encode to the bytes it came from (`meshwork::comm::net::frame::exercise_decoder`,
//! which the corpus-replay test calls too).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshwork::comm::net::frame::exercise_decoder(data));
