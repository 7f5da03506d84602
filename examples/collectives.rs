//! Collectives without the job runtime: four ranks, each on its own thread, all-reduce a
//! buffer and all-gather their shares.
//!
//! Run with `cargo run --example collectives`.

// ANCHOR: imports
use std::thread;

use meshwork::comm::{Algorithm, CommConfig, LocalGroup, ReduceOp, chunk_range};
use meshwork::mesh::Generation;
// ANCHOR_END: imports

// ANCHOR: main
fn main() -> Result<(), meshwork::comm::CommError> {
    let world = 4;
    let config = CommConfig::default().with_algorithm(Algorithm::Direct);
    let group = LocalGroup::new(world, Generation(0), config);
    let handles: Vec<_> = group
        .communicators()
        .into_iter()
        .map(|mut comm| {
            thread::spawn(
                move || -> Result<(Vec<f32>, Vec<f32>), meshwork::comm::CommError> {
                    let rank = comm.rank().index();
                    // Each rank holds 10 values equal to its rank + 1; the sum is 1+2+3+4 = 10.
                    let mut grads = vec![(rank + 1) as f32; 10];
                    comm.all_reduce(&mut grads, ReduceOp::Sum)?;
                    // Each rank contributes its share of a 10-element buffer (10 = 3+3+2+2).
                    let mine = chunk_range(10, world, rank);
                    let share = vec![rank as f32; mine.len()];
                    let mut gathered = vec![0.0; 10];
                    comm.all_gather(&share, &mut gathered)?;
                    Ok((grads, gathered))
                },
            )
        })
        .collect();
    for h in handles {
        let (sum, gathered) = h.join().expect("rank thread")?;
        assert!(sum.iter().all(|v| *v == 10.0));
        assert_eq!(gathered, [0., 0., 0., 1., 1., 1., 2., 2., 3., 3.]);
    }
    println!("all_reduce and all_gather agree on every rank");
    Ok(())
}
// ANCHOR_END: main
