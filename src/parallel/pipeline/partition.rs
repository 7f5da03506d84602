//! Cutting a model's layers into pipeline blocks of balanced cost.
//!
//! PART-1: [`balanced_split`] returns run lengths that are all ≥ 1, sum to the number of
//! layers, and minimize the largest run's total cost over every contiguous split (the slowest
//! stage sets a pipeline's pace).

/// Cut `costs` (one per layer, in order) into `parts` runs of consecutive layers so that the
/// largest run total is as small as possible (PART-1). Returns the run lengths, or `None` when
/// `parts` is 0 or exceeds the number of layers.
pub fn balanced_split(costs: &[u64], parts: usize) -> Option<Vec<usize>> {
    let n = costs.len();
    if parts == 0 || parts > n {
        return None;
    }
    let prefix: Vec<u64> = std::iter::once(0)
        .chain(costs.iter().scan(0u64, |s, &c| {
            *s = s.saturating_add(c);
            Some(*s)
        }))
        .collect();
    let run = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[j][i]: the smallest largest-run total for the first i layers in j runs, and where
    // its last run starts.
    let mut best = vec![vec![(u64::MAX, 0usize); n + 1]; parts + 1];
    best[0][0] = (0, 0);
    for j in 1..=parts {
        for i in j..=n {
            for start in (j - 1)..i {
                let (before, _) = best[j - 1][start];
                if before == u64::MAX {
                    continue;
                }
                let cost = before.max(run(start, i));
                // Strictly better only: among equal splits the last run starts earliest.
                if cost < best[j][i].0 {
                    best[j][i] = (cost, start);
                }
            }
        }
    }
    let mut sizes = vec![0; parts];
    let mut end = n;
    for j in (1..=parts).rev() {
        let start = best[j][end].1;
        sizes[j - 1] = end - start;
        end = start;
    }
    Some(sizes)
}

/// Lengths of `parts` runs of (almost) equal count over `layers` layers, the extra layers on
/// the later runs; `None` when `parts` is 0 or exceeds `layers`.
pub fn even_split(layers: usize, parts: usize) -> Option<Vec<usize>> {
    if parts == 0 || parts > layers {
        return None;
    }
    Some(
        (0..parts)
            .map(|s| layers / parts + usize::from(s >= parts - layers % parts))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn largest(costs: &[u64], sizes: &[usize]) -> u64 {
        let mut at = 0;
        sizes
            .iter()
            .map(|&s| {
                let t = costs[at..at + s].iter().sum();
                at += s;
                t
            })
            .max()
            .unwrap_or(0)
    }

    /// Every way to cut `n` layers into `parts` non-empty runs.
    fn all_splits(n: usize, parts: usize) -> Vec<Vec<usize>> {
        if parts == 1 {
            return vec![vec![n]];
        }
        (1..=n.saturating_sub(parts - 1))
            .flat_map(|first| {
                all_splits(n - first, parts - 1)
                    .into_iter()
                    .map(move |mut rest| {
                        rest.insert(0, first);
                        rest
                    })
            })
            .collect()
    }

    proptest! {
        #[test]
        fn part_1_balanced_split_is_optimal(
            costs in proptest::collection::vec(0u64..1000, 1..9),
            parts in 1usize..5,
        ) {
            let n = costs.len();
            let Some(sizes) = balanced_split(&costs, parts) else {
                prop_assert!(parts > n);
                return Ok(());
            };
            prop_assert_eq!(sizes.len(), parts);
            prop_assert!(sizes.iter().all(|&s| s >= 1));
            prop_assert_eq!(sizes.iter().sum::<usize>(), n);
            let got = largest(&costs, &sizes);
            for other in all_splits(n, parts) {
                prop_assert!(got <= largest(&costs, &other), "{:?} beats {:?}", other, sizes);
            }
            let even = even_split(n, parts).unwrap();
            prop_assert!(got <= largest(&costs, &even));
        }
    }

    #[test]
    fn even_split_puts_extra_layers_last() {
        assert_eq!(even_split(9, 2), Some(vec![4, 5]));
        assert_eq!(even_split(3, 3), Some(vec![1, 1, 1]));
        assert_eq!(even_split(2, 3), None);
        assert_eq!(balanced_split(&[1, 1], 0), None);
        assert_eq!(balanced_split(&[5, 1, 1, 1, 1, 1], 2), Some(vec![1, 5]));
    }
}
