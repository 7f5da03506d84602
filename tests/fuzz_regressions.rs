//! Replays the fuzzers' committed inputs (the seed corpus in `fuzz/corpus/*/` and any crash in
//! `fuzz/artifacts/*/`) through the decoders, so CI checks them without a fuzzing toolchain.
//! FRAME-5: no input panics.
#![cfg(feature = "cluster")]

use std::fs;
use std::path::{Path, PathBuf};

use meshwork::cluster::frame::{self, FrameKind, HEADER_LEN, exercise_decoder};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// Every file one level below `fuzz/<kind>/<target>/`.
fn inputs(kind: &str) -> Vec<PathBuf> {
    let Ok(targets) = fs::read_dir(fuzz_dir().join(kind)) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = targets
        .flatten()
        .filter(|t| t.path().is_dir())
        .flat_map(|t| fs::read_dir(t.path()).into_iter().flatten().flatten())
        .map(|f| f.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn frame_5_committed_fuzz_inputs_never_panic() {
    let corpus = inputs("corpus");
    assert!(
        corpus.len() >= 8,
        "the seed corpus is missing: {} files",
        corpus.len()
    );
    for path in corpus.iter().chain(&inputs("artifacts")) {
        let data = fs::read(path).unwrap();
        let outcome = std::panic::catch_unwind(|| exercise_decoder(&data));
        assert!(outcome.is_ok(), "{} panicked the decoder", path.display());
    }
}

/// Rewrites the seed corpus: valid frames of each kind, truncated and corrupted ones.
/// `cargo test --features cluster --test fuzz_regressions -- --ignored write_seed_corpus`.
#[test]
#[ignore = "writes fuzz/corpus/frame_decoder; run by hand when the format changes"]
fn write_seed_corpus() {
    let dir = fuzz_dir().join("corpus").join("frame_decoder");
    fs::create_dir_all(&dir).unwrap();
    let data: Vec<u8> = (0..64u8).collect();
    let mut f32s = Vec::new();
    frame::put_f32s(&[1.0, -2.5, f32::NAN, 0.0], &mut f32s);
    let mut seeds: Vec<(String, Vec<u8>)> = vec![
        ("hello".into(), frame::encode(FrameKind::Hello, 0, &[7; 36])),
        ("ack".into(), frame::encode(FrameKind::Ack, 0, &[0; 4])),
        ("data".into(), frame::encode(FrameKind::Data, 1, &data)),
        ("data_f32".into(), frame::encode(FrameKind::Data, 2, &f32s)),
        ("empty".into(), frame::encode(FrameKind::Data, 3, &[])),
        ("close".into(), frame::encode(FrameKind::Close, 9, &[])),
    ];
    let two: Vec<u8> = [
        frame::encode(FrameKind::Data, 1, b"first"),
        frame::encode(FrameKind::Data, 2, b"second"),
    ]
    .concat();
    seeds.push(("two_frames".into(), two));
    let valid = frame::encode(FrameKind::Data, 1, &data);
    seeds.push(("truncated_header".into(), valid[..HEADER_LEN / 2].to_vec()));
    seeds.push((
        "truncated_payload".into(),
        valid[..HEADER_LEN + 10].to_vec(),
    ));
    for (name, at) in [
        ("bad_magic", 0),
        ("bad_version", 4),
        ("bad_kind", 6),
        ("bad_length", 16),
        ("bad_header_crc", HEADER_LEN - 1),
        ("bad_payload", HEADER_LEN + 5),
    ] {
        let mut bytes = valid.clone();
        bytes[at] ^= 0x40;
        seeds.push((name.into(), bytes));
    }
    let mut oversize = frame::encode_header(FrameKind::Data, 1, &[]);
    oversize[15..23].copy_from_slice(&u64::MAX.to_le_bytes());
    seeds.push(("oversize_declared".into(), oversize.to_vec()));
    for (name, bytes) in seeds {
        fs::write(dir.join(name), bytes).unwrap();
    }
}
