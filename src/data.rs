//! Datasets: what a job reads its samples from.
//!
//! A dataset is indexed by sample id (`0..len`); the [`crate::parallel::sampler`] decides which
//! ids each replica reads at each step, and the ids travel in every step-done event.
//!
//! With the `burn-dataset` feature (on by default), [`FromBurn`] lets any
//! `burn::data::dataset::Dataset` be a job's data, read in place.
//!
//! [`text`] turns a text into character tokens, a training and a validation split and
//! fixed-length windows over each ([`TextWindows`], a [`Dataset`]), for character-level
//! language models.

use std::sync::Arc;

pub mod text;

pub use text::{CharCorpus, CharVocab, TextError, TextWindow, TextWindows};

/// Random access to the samples of a job. Shared by every device thread, so `Send + Sync`.
pub trait Dataset: Send + Sync + 'static {
    /// One sample.
    type Item: Send + Sync + 'static;

    /// Number of samples; ids are `0..len()`.
    fn len(&self) -> usize;

    /// The sample with this id, or `None` when the id is out of range or unreadable.
    fn get(&self, index: usize) -> Option<Self::Item>;

    /// Whether the dataset has no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dataset held in memory as a vector of samples.
#[derive(Debug, Clone)]
pub struct InMemoryDataset<T> {
    items: Arc<Vec<T>>,
}

impl<T> InMemoryDataset<T> {
    /// A dataset over these samples; sample `i` has id `i`.
    pub fn new(items: Vec<T>) -> Self {
        Self {
            items: Arc::new(items),
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Dataset for InMemoryDataset<T> {
    type Item = T;

    fn len(&self) -> usize {
        self.items.len()
    }

    fn get(&self, index: usize) -> Option<T> {
        self.items.get(index).cloned()
    }
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    type Item = D::Item;
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get(&self, index: usize) -> Option<D::Item> {
        (**self).get(index)
    }
}

/// A Burn dataset (`burn::data::dataset::Dataset<I, E>`) as a job's data, read in place: no
/// item is copied until a device thread asks for it, through Burn's own `get`.
///
/// Burn's `get` panics on an out-of-range index and returns `Err` for an unreadable item;
/// here both are `None`, as [`Dataset::get`] promises (an id past `len()` is never passed to
/// Burn). Wrap an `Arc<D>` to keep using the dataset elsewhere: Burn implements its trait for
/// `Arc<D>`.
///
/// ```
/// use burn::data::dataset::InMemDataset;
/// use burn::optim::SgdConfig;
/// use burn::tensor::Device;
/// use meshwork::data::FromBurn;
/// use meshwork::demo::{Mlp, TeacherTask, mse_loss};
/// use meshwork::prelude::*;
///
/// // Any Burn dataset; here Burn's in-memory one, over meshwork's demo samples.
/// let task = TeacherTask { d_in: 4, d_out: 2, noise: 0.1, seed: 1 };
/// let demo = task.dataset(64);
/// let samples = (0..demo.len()).filter_map(|i| demo.get(i)).collect();
/// let burn_data = InMemDataset::new(samples);
///
/// let data = FromBurn::new(burn_data);
/// assert_eq!(data.len(), 64);
/// assert!(data.get(64).is_none(), "out of range is None, not Burn's panic");
///
/// let job = Job::builder()
///     .initial_model(Mlp::new(&[4, 8, 2], &Device::flex()))
///     .loss(mse_loss)
///     .data(data)
///     .optimizer(SgdConfig::new())
///     .learning_rate(0.05)
///     .batch_size(16)
///     .steps(2)
///     .build();
/// assert!(job.is_ok());
/// ```
#[cfg(feature = "burn-dataset")]
pub struct FromBurn<D, I, E = burn::data::dataset::DatasetError> {
    dataset: D,
    items: std::marker::PhantomData<fn() -> (I, E)>,
}

#[cfg(feature = "burn-dataset")]
impl<D, I, E> FromBurn<D, I, E>
where
    D: burn::data::dataset::Dataset<I, E>,
    E: std::error::Error + Send + Sync + 'static,
{
    /// Read `dataset` in place: sample id `i` is Burn's item `i`.
    pub fn new(dataset: D) -> Self {
        Self {
            dataset,
            items: std::marker::PhantomData,
        }
    }

    /// The wrapped Burn dataset.
    pub fn inner(&self) -> &D {
        &self.dataset
    }

    /// The Burn dataset back.
    pub fn into_inner(self) -> D {
        self.dataset
    }
}

#[cfg(feature = "burn-dataset")]
impl<D, I, E> Dataset for FromBurn<D, I, E>
where
    D: burn::data::dataset::Dataset<I, E> + 'static,
    I: Send + Sync + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    type Item = I;

    fn len(&self) -> usize {
        self.dataset.len()
    }

    fn get(&self, index: usize) -> Option<I> {
        if index >= self.dataset.len() {
            return None;
        }
        self.dataset.get(index).ok()
    }
}

#[cfg(feature = "burn-dataset")]
impl<D, I, E> std::fmt::Debug for FromBurn<D, I, E>
where
    D: burn::data::dataset::Dataset<I, E>,
    E: std::error::Error + Send + Sync + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FromBurn({}, {} items)",
            std::any::type_name::<D>(),
            self.dataset.len()
        )
    }
}

#[cfg(all(test, feature = "burn-dataset"))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use burn::data::dataset::{Dataset as BurnDataset, DatasetError, InMemDataset};

    use super::{Dataset, FromBurn};

    /// A Burn dataset that counts its reads and fails on odd ids.
    struct Counting {
        items: Vec<u32>,
        reads: Arc<AtomicUsize>,
    }

    impl BurnDataset<u32> for Counting {
        fn get(&self, index: usize) -> Result<u32, DatasetError> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            match self.items[index] {
                v if v % 2 == 1 => Err(DatasetError::new(std::io::Error::other(format!(
                    "odd item {v}"
                )))),
                v => Ok(v),
            }
        }
        fn len(&self) -> usize {
            self.items.len()
        }
    }

    #[test]
    fn from_burn_reads_items_in_place_and_maps_errors_and_range_to_none() {
        let reads = Arc::new(AtomicUsize::new(0));
        let data = FromBurn::new(Counting {
            items: vec![10, 11, 12],
            reads: reads.clone(),
        });
        assert_eq!(reads.load(Ordering::SeqCst), 0, "wrapping reads nothing");
        assert_eq!(Dataset::len(&data), 3);
        assert_eq!(Dataset::get(&data, 0), Some(10));
        assert_eq!(Dataset::get(&data, 1), None, "a Burn error is None");
        assert_eq!(Dataset::get(&data, 2), Some(12));
        assert_eq!(
            Dataset::get(&data, 3),
            None,
            "out of range is None, not Burn's panic"
        );
        assert_eq!(
            reads.load(Ordering::SeqCst),
            3,
            "one Burn read per get in range"
        );
    }

    #[test]
    fn from_burn_shares_an_arc_dataset_without_copying_it() {
        let burn = Arc::new(InMemDataset::new(vec![1.5f32, 2.5]));
        let data = FromBurn::new(burn.clone());
        assert!(Arc::ptr_eq(data.inner(), &burn));
        assert_eq!(Dataset::get(&data, 1), Some(2.5));
        assert_eq!(BurnDataset::len(&*burn), 2);
    }
}
