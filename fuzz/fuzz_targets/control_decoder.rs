//! Fuzzes the control plane's message decoder: arbitrary bytes, as a whole message (header and
//! body) and as a bare body, must give a control message or a typed error, never a panic or an
//! allocation past the maximum (CTL-2), and a decoded message must encode again stably
//! (`meshwork::cluster::control::protocol::exercise_decoder`, which the corpus-replay test
//! calls too).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshwork::cluster::control::protocol::exercise_decoder(data));
