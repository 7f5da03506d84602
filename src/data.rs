//! Datasets: what a job reads its samples from.
//!
//! A dataset is indexed by sample id (`0..len`); the [`crate::parallel::sampler`] decides which
//! ids each replica reads at each step, and the ids travel in every step-done event.

use std::sync::Arc;

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
