//! The King James Bible, shipped with the crate as the text of the character-level demo
//! models: `data/kjv/kjv.txt.gz` (public domain; where it comes from and how it was cleaned
//! is in `data/kjv/LICENSE.md`), embedded in the library and decompressed in memory. Nothing
//! is downloaded at build or run time.

use std::io::Read;

use crate::data::{CharCorpus, TextError};

/// The gzipped text, as shipped in the repository.
const KJV_GZ: &[u8] = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/data/kjv/kjv.txt.gz"));

/// The share of the text [`kjv_corpus`] holds out for validation: its last tenth (the end of
/// the New Testament).
pub const KJV_VALIDATION_FRACTION: f64 = 0.1;

/// Why the embedded text could not be read. Only a corrupted build produces one.
#[derive(Debug, thiserror::Error)]
pub enum KjvError {
    /// The embedded gzip stream does not decompress.
    #[error("the embedded King James text does not decompress: {0}")]
    Decompress(#[source] std::io::Error),
    /// The decompressed bytes are not UTF-8.
    #[error("the embedded King James text is not UTF-8: {0}")]
    NotUtf8(#[source] std::string::FromUtf8Error),
    /// The text does not make a corpus.
    #[error("the embedded King James text does not make a corpus: {0}")]
    Corpus(#[from] TextError),
}

/// The King James Bible: every verse on its own line, without verse numbers (about 4.1 MB,
/// 63 distinct characters). Each call decompresses the embedded copy (some tens of
/// milliseconds).
pub fn kjv_text() -> Result<String, KjvError> {
    let mut bytes = Vec::with_capacity(KJV_GZ.len() * 4);
    flate2::read::GzDecoder::new(KJV_GZ)
        .read_to_end(&mut bytes)
        .map_err(KjvError::Decompress)?;
    String::from_utf8(bytes).map_err(KjvError::NotUtf8)
}

/// The King James Bible as a character corpus, its last [`KJV_VALIDATION_FRACTION`] held out
/// for validation.
pub fn kjv_corpus() -> Result<CharCorpus, KjvError> {
    Ok(CharCorpus::new(&kjv_text()?, KJV_VALIDATION_FRACTION)?)
}

#[cfg(test)]
mod tests {
    use super::{kjv_corpus, kjv_text};
    use crate::data::Dataset;

    /// The shipped text decodes, is over 1 MB with a small vocabulary, and its unigram baseline
    /// (the line a character model must get below) is that of English prose.
    #[test]
    fn embedded_kjv_decodes_to_a_corpus_with_an_english_unigram_baseline() {
        let text = kjv_text().unwrap();
        assert!(text.len() >= 1 << 20, "{} bytes", text.len());
        assert!(text.starts_with("In the beginning God created the heaven and the earth.\n"));
        assert!(text.ends_with("The grace of our Lord Jesus Christ be with you all. Amen.\n"));
        assert!(
            !text.chars().any(|c| c.is_ascii_digit()),
            "verse numbers dropped"
        );

        let corpus = kjv_corpus().unwrap();
        let vocab = corpus.vocab();
        assert!(vocab.len() < 100, "{} characters", vocab.len());
        let chars = text.chars().count();
        assert_eq!(corpus.train().len() + corpus.validation().len(), chars);
        assert_eq!(corpus.validation().len(), chars / 10);
        let baseline = corpus.unigram_baseline();
        println!(
            "KJV: {} bytes, {} characters in the vocabulary, {} training / {} validation \
             characters, unigram baseline {baseline:.4} nats/char",
            text.len(),
            vocab.len(),
            corpus.train().len(),
            corpus.validation().len()
        );
        assert!(
            baseline.is_finite() && baseline > 2.0 && baseline < 4.5,
            "{baseline}"
        );

        let windows = corpus.validation_windows(64, 64).unwrap();
        let last = windows.get(windows.len() - 1).unwrap();
        assert_eq!(last.tokens.len(), 65);
        assert!(vocab.decode(&last.tokens).is_ok());
    }
}
