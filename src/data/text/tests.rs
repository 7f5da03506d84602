use std::sync::Arc;

use proptest::prelude::*;

use super::{CharCorpus, CharVocab, TextError, TextWindows};
use crate::data::Dataset;

/// A vocabulary text (1..12 distinct characters, some outside ASCII) and a string over it.
fn vocab_and_string() -> impl Strategy<Value = (String, String)> {
    proptest::collection::vec(
        prop_oneof![
            proptest::char::range('a', 'z'),
            Just('\n'),
            Just('é'),
            Just('𝄞')
        ],
        1..12,
    )
    .prop_flat_map(|alphabet| {
        let picks = proptest::collection::vec(proptest::sample::select(alphabet.clone()), 0..64);
        (Just(alphabet.into_iter().collect::<String>()), picks)
    })
    .prop_map(|(alphabet, picks)| (alphabet, picks.into_iter().collect()))
}

proptest! {
    /// TEXT-1: encoding then decoding gives the string back, one token per character.
    #[test]
    fn decode_of_encode_is_identity((alphabet, s) in vocab_and_string()) {
        let vocab = CharVocab::new(&alphabet).unwrap();
        let tokens = vocab.encode(&s).unwrap();
        prop_assert_eq!(tokens.len(), s.chars().count());
        prop_assert!(tokens.iter().all(|&t| (t as usize) < vocab.len()));
        prop_assert_eq!(vocab.decode(&tokens).unwrap(), s);
        prop_assert!(vocab.chars().windows(2).all(|w| w[0] < w[1]), "sorted and distinct");
    }

    /// TEXT-1: a character outside the vocabulary is named with its position.
    #[test]
    fn unknown_char_is_named((alphabet, s) in vocab_and_string(), at in 0usize..64) {
        let vocab = CharVocab::new(&alphabet).unwrap();
        let mut chars: Vec<char> = s.chars().collect();
        let position = at.min(chars.len());
        chars.insert(position, '#');
        let text: String = chars.into_iter().collect();
        prop_assert_eq!(vocab.encode(&text), Err(TextError::UnknownChar { ch: '#', position }));
        let bad = vocab.len() as u32;
        prop_assert_eq!(
            vocab.decode(&[0, bad]),
            Err(TextError::UnknownToken { token: bad, vocab_len: vocab.len() })
        );
    }

    /// TEXT-2: each window is its split's slice at `i * stride`, targets are inputs shifted by
    /// one, every window lies inside the split, and no further window would fit.
    #[test]
    fn windows_are_shifted_slices_inside_the_split(
        len in 2usize..200,
        seq_len in 1usize..40,
        stride in 1usize..50,
    ) {
        let tokens: Arc<[u32]> = (0..len as u32).map(|t| t * 7 % 13).collect();
        let windows = match TextWindows::new(tokens.clone(), seq_len, stride) {
            Err(e) => {
                prop_assert!(len < seq_len + 1);
                prop_assert_eq!(e, TextError::TooShort { tokens: len, needed: seq_len + 1 });
                return Ok(());
            }
            Ok(w) => w,
        };
        prop_assert!(windows.len() >= 1);
        for i in 0..windows.len() {
            let w = windows.get(i).unwrap();
            let start = windows.start(i).unwrap();
            prop_assert_eq!(start, i * stride);
            prop_assert!(start + seq_len < len, "window {} ends inside the split", i);
            prop_assert_eq!(&w.tokens[..], &tokens[start..start + seq_len + 1]);
            prop_assert_eq!(w.inputs().len(), seq_len);
            prop_assert_eq!(w.targets().len(), seq_len);
            prop_assert_eq!(&w.targets()[..seq_len - 1], &w.inputs()[1..]);
        }
        let next = windows.len() * stride;
        prop_assert!(next + seq_len + 1 > len, "one more window would have fitted");
        prop_assert!(windows.get(windows.len()).is_none());
    }

    /// TEXT-2, TEXT-3: training windows come from the text's beginning and validation windows
    /// from its held-out end; the two splits together are the whole text.
    #[test]
    fn corpus_windows_stay_in_their_split(
        (alphabet, s) in vocab_and_string(),
        fraction in 0.05f64..0.95,
        seq_len in 1usize..4,
        stride in 1usize..4,
    ) {
        let text = format!("{alphabet}{s}{alphabet}{s}");
        let chars: Vec<char> = text.chars().collect();
        let corpus = match CharCorpus::new(&text, fraction) {
            Ok(c) => c,
            Err(TextError::EmptySplit { chars: n, .. }) => {
                let held = (n as f64 * fraction).floor() as usize;
                prop_assert!(held == 0 || held >= n);
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
        };
        let held = (chars.len() as f64 * fraction).floor() as usize;
        prop_assert_eq!(corpus.validation().len(), held);
        prop_assert_eq!(corpus.train().len() + held, chars.len());
        let cut = chars.len() - held;
        let head: String = chars[..cut].iter().collect();
        let tail: String = chars[cut..].iter().collect();
        prop_assert_eq!(corpus.vocab().decode(corpus.train()).unwrap(), head);
        prop_assert_eq!(corpus.vocab().decode(corpus.validation()).unwrap(), tail);
        for (windows, split) in [
            (corpus.train_windows(seq_len, stride), corpus.train()),
            (corpus.validation_windows(seq_len, stride), corpus.validation()),
        ] {
            let Ok(windows) = windows else { continue };
            for i in 0..windows.len() {
                let start = windows.start(i).unwrap();
                prop_assert_eq!(
                    &windows.get(i).unwrap().tokens[..],
                    &split[start..start + seq_len + 1]
                );
            }
        }
    }
}

/// TEXT-4 by hand: "aabac" at 0.4 trains on "aab", validates on "ac"; V = 3, so
/// p(a) = (2+1)/(3+3) = 1/2 and p(c) = (0+1)/6 = 1/6, and the cross-entropy is
/// (ln 2 + ln 6) / 2 = ln(12) / 2.
#[test]
fn unigram_baseline_equals_hand_computed_cross_entropy() {
    let corpus = CharCorpus::new("aabac", 0.4).unwrap();
    assert_eq!(corpus.vocab().chars(), &['a', 'b', 'c']);
    assert_eq!(corpus.train(), &[0, 0, 1]);
    assert_eq!(corpus.validation(), &[0, 2]);
    let expected = 12f64.ln() / 2.0;
    let got = corpus.unigram_baseline();
    assert!((got - expected).abs() < 1e-12, "{got} != {expected}");
}

#[test]
fn bad_windows_and_splits_are_typed_errors() {
    let tokens: Arc<[u32]> = Arc::from(vec![0u32, 1, 2]);
    assert_eq!(
        TextWindows::new(tokens.clone(), 0, 1).unwrap_err(),
        TextError::ZeroSeqLen
    );
    assert_eq!(
        TextWindows::new(tokens.clone(), 1, 0).unwrap_err(),
        TextError::ZeroStride
    );
    assert_eq!(
        TextWindows::new(tokens, 3, 1).unwrap_err(),
        TextError::TooShort {
            tokens: 3,
            needed: 4
        }
    );
    for bad in [0.0, 1.0, -0.5, f64::NAN] {
        assert!(matches!(
            CharCorpus::new("abcdef", bad),
            Err(TextError::InvalidFraction(_))
        ));
    }
    assert_eq!(
        CharCorpus::new("abc", 0.2).unwrap_err(),
        TextError::EmptySplit {
            chars: 3,
            fraction: 0.2
        }
    );
}
