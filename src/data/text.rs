//! Character-level text as a job's data: a vocabulary of characters, a text split into a
//! training and a held-out validation part, fixed-length windows over each part, and the
//! unigram baseline a language model must beat.
//!
//! Invariants (tested in `text/tests.rs`):
//! - **TEXT-1** `vocab.decode(vocab.encode(s)?)? == s` for every string over the vocabulary;
//!   a character outside it is `TextError::UnknownChar` naming the character and its position,
//!   a token outside it `TextError::UnknownToken`.
//! - **TEXT-2** window `i` of a [`TextWindows`] is the `seq_len + 1` tokens of its split
//!   starting at `i * stride`: inputs are its first `seq_len` tokens, targets the same tokens
//!   shifted by one. Every window lies inside its split (no window crosses from training into
//!   validation), and there are as many windows as fit.
//! - **TEXT-3** a [`CharCorpus`] holds out the last `floor(n · validation_fraction)`
//!   characters of the text as validation, the rest is training; both are non-empty, and the
//!   vocabulary is the whole text's, so every validation character has a token.
//! - **TEXT-4** [`CharCorpus::unigram_baseline`] is the cross-entropy, in nats per character,
//!   of the validation split under character frequencies counted on the training split with
//!   add-one smoothing over the vocabulary: `-(1/|val|) Σ ln((count(c) + 1) / (|train| + V))`.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::Dataset;

/// What can go wrong turning text into tokens, windows or a corpus.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TextError {
    /// The text has a character the vocabulary does not hold.
    #[error("character {ch:?} (at character {position}) is not in the vocabulary")]
    UnknownChar {
        /// The character.
        ch: char,
        /// Its index in the text, counted in characters.
        position: usize,
    },
    /// A token is not an index of the vocabulary.
    #[error("token {token} is not in a vocabulary of {vocab_len} characters")]
    UnknownToken {
        /// The token.
        token: u32,
        /// The vocabulary's size.
        vocab_len: usize,
    },
    /// Windows need at least one input token.
    #[error("a window needs a sequence length of at least 1")]
    ZeroSeqLen,
    /// Windows need to advance.
    #[error("windows need a stride of at least 1")]
    ZeroStride,
    /// The tokens do not fill one window.
    #[error("{tokens} tokens do not fill one window of {needed} (sequence length + 1)")]
    TooShort {
        /// Tokens available.
        tokens: usize,
        /// Tokens one window needs.
        needed: usize,
    },
    /// The validation fraction is not strictly between 0 and 1.
    #[error("validation fraction {0} is not strictly between 0 and 1")]
    InvalidFraction(f64),
    /// The split leaves the training or the validation part empty.
    #[error("{chars} characters split at validation fraction {fraction} leave a part empty")]
    EmptySplit {
        /// Characters in the text.
        chars: usize,
        /// The validation fraction asked for.
        fraction: f64,
    },
    /// The vocabulary would not fit token ids in `u32`.
    #[error("{0} distinct characters do not fit u32 token ids")]
    VocabTooLarge(usize),
}

/// The characters of a text, sorted; a character's token is its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharVocab {
    chars: Vec<char>,
}

impl CharVocab {
    /// The distinct characters of `text`, sorted by code point.
    pub fn new(text: &str) -> Result<Self, TextError> {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        if u32::try_from(chars.len()).is_err() {
            return Err(TextError::VocabTooLarge(chars.len()));
        }
        Ok(Self { chars })
    }

    /// Number of characters (tokens are `0..len()`).
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether the vocabulary holds no character (built from an empty text).
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The characters, sorted; character `i` has token `i`.
    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    /// The token of `ch`, if the vocabulary holds it.
    pub fn token(&self, ch: char) -> Option<u32> {
        // The constructor checked that every index fits u32.
        self.chars.binary_search(&ch).ok().map(|i| i as u32)
    }

    /// The character of `token`, if it is in range.
    pub fn char(&self, token: u32) -> Option<char> {
        self.chars.get(token as usize).copied()
    }

    /// The tokens of `text`, one per character (TEXT-1).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        text.chars()
            .enumerate()
            .map(|(position, ch)| {
                self.token(ch)
                    .ok_or(TextError::UnknownChar { ch, position })
            })
            .collect()
    }

    /// The text of `tokens` (TEXT-1).
    pub fn decode(&self, tokens: &[u32]) -> Result<String, TextError> {
        tokens
            .iter()
            .map(|&token| {
                self.char(token).ok_or(TextError::UnknownToken {
                    token,
                    vocab_len: self.len(),
                })
            })
            .collect()
    }
}

/// One training sample of a character model: `seq_len + 1` consecutive tokens. The model reads
/// [`inputs`](Self::inputs) and predicts [`targets`](Self::targets), the same tokens one ahead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextWindow {
    /// The tokens, `seq_len + 1` of them.
    pub tokens: Vec<u32>,
}

impl TextWindow {
    /// The model's input: every token but the last.
    pub fn inputs(&self) -> &[u32] {
        &self.tokens[..self.tokens.len().saturating_sub(1)]
    }

    /// What the model must predict at each input position: every token but the first.
    pub fn targets(&self) -> &[u32] {
        self.tokens.get(1..).unwrap_or(&[])
    }
}

impl AsRef<[u32]> for TextWindow {
    /// All `seq_len + 1` tokens (what a model's batch is cut from).
    fn as_ref(&self) -> &[u32] {
        &self.tokens
    }
}

/// Windows of `seq_len + 1` tokens taken every `stride` tokens over one split (TEXT-2), as a
/// job's [`Dataset`]. Cloning shares the tokens.
#[derive(Debug, Clone)]
pub struct TextWindows {
    tokens: Arc<[u32]>,
    seq_len: usize,
    stride: usize,
    windows: usize,
}

impl TextWindows {
    /// Windows over `tokens`; the first starts at 0, the last is the last that fits.
    pub fn new(tokens: Arc<[u32]>, seq_len: usize, stride: usize) -> Result<Self, TextError> {
        if seq_len == 0 {
            return Err(TextError::ZeroSeqLen);
        }
        if stride == 0 {
            return Err(TextError::ZeroStride);
        }
        let needed = seq_len.checked_add(1).ok_or(TextError::TooShort {
            tokens: tokens.len(),
            needed: usize::MAX,
        })?;
        if tokens.len() < needed {
            return Err(TextError::TooShort {
                tokens: tokens.len(),
                needed,
            });
        }
        let windows = (tokens.len() - needed) / stride + 1;
        Ok(Self {
            tokens,
            seq_len,
            stride,
            windows,
        })
    }

    /// Input tokens per window (a window holds one more).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Tokens between the starts of two consecutive windows.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Where window `index` starts in its split, if it exists.
    pub fn start(&self, index: usize) -> Option<usize> {
        (index < self.windows).then(|| index * self.stride)
    }

    /// The split the windows are taken from.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl Dataset for TextWindows {
    type Item = TextWindow;

    fn len(&self) -> usize {
        self.windows
    }

    fn get(&self, index: usize) -> Option<TextWindow> {
        let start = self.start(index)?;
        let tokens = self.tokens.get(start..start + self.seq_len + 1)?.to_vec();
        Some(TextWindow { tokens })
    }
}

/// A text as tokens, split into training and held-out validation parts (TEXT-3).
#[derive(Debug, Clone)]
pub struct CharCorpus {
    vocab: CharVocab,
    train: Arc<[u32]>,
    validation: Arc<[u32]>,
}

impl CharCorpus {
    /// `text` tokenised with its own vocabulary; the last `validation_fraction` of its
    /// characters (rounded down) are held out. Both parts must be non-empty.
    pub fn new(text: &str, validation_fraction: f64) -> Result<Self, TextError> {
        if !(validation_fraction > 0.0 && validation_fraction < 1.0) {
            return Err(TextError::InvalidFraction(validation_fraction));
        }
        let vocab = CharVocab::new(text)?;
        let tokens = vocab.encode(text)?;
        let chars = tokens.len();
        // Exact for any text that fits in memory: f64 holds integers up to 2^53.
        let held_out = (chars as f64 * validation_fraction).floor() as usize;
        if held_out == 0 || held_out >= chars {
            return Err(TextError::EmptySplit {
                chars,
                fraction: validation_fraction,
            });
        }
        let cut = chars - held_out;
        Ok(Self {
            vocab,
            train: Arc::from(&tokens[..cut]),
            validation: Arc::from(&tokens[cut..]),
        })
    }

    /// The vocabulary of the whole text.
    pub fn vocab(&self) -> &CharVocab {
        &self.vocab
    }

    /// The training split's tokens (the text's beginning).
    pub fn train(&self) -> &[u32] {
        &self.train
    }

    /// The validation split's tokens (the text's end).
    pub fn validation(&self) -> &[u32] {
        &self.validation
    }

    /// Windows over the training split.
    pub fn train_windows(&self, seq_len: usize, stride: usize) -> Result<TextWindows, TextError> {
        TextWindows::new(self.train.clone(), seq_len, stride)
    }

    /// Windows over the validation split.
    pub fn validation_windows(
        &self,
        seq_len: usize,
        stride: usize,
    ) -> Result<TextWindows, TextError> {
        TextWindows::new(self.validation.clone(), seq_len, stride)
    }

    /// The validation cross-entropy, in nats per character, of the unigram model estimated on
    /// the training split with add-one smoothing (TEXT-4): what a model that ignores context
    /// reaches, so the line a language model must get below.
    pub fn unigram_baseline(&self) -> f64 {
        let mut counts = vec![0u64; self.vocab.len()];
        for &t in self.train.iter() {
            counts[t as usize] += 1;
        }
        let denominator = (self.train.len() + self.vocab.len()) as f64;
        let log_p: Vec<f64> = counts
            .iter()
            .map(|&c| ((c + 1) as f64 / denominator).ln())
            .collect();
        let total: f64 = self.validation.iter().map(|&t| log_p[t as usize]).sum();
        -total / self.validation.len() as f64
    }
}

#[cfg(test)]
mod tests;
