//! The walk with a fake block: no Burn, two ranks of a local group on threads, a block job's
//! list (one stage holding every block). A fake block gathers for every use and logs what the
//! walk asks of it, in order, so the tests read the walk's decisions from the log: the order
//! of the gathers, how many are issued ahead of their use (EXEC-5), and which block a failed
//! collective is named with (OVL-3).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::comm::{CollectiveKind, CommConfig, LocalGroup};
use crate::mesh::Generation;
use crate::parallel::pipeline_exec::links;
use crate::parallel::sync::Collective;

/// Parameters of each fake block's shard.
const SHARD: usize = 3;

/// What the walk asked of a fake block, in order.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    /// `start_gather` of the block.
    Issue(u32),
    /// `finish_gather` of the block, with the full parameters the all-gather brought.
    Take(u32, Vec<f32>),
    /// A forward or backward of the block, with the gathers issued but not yet taken then.
    Compute(u32, usize),
}

/// A block whose parameters are all-gathered before each use: `SHARD` values per rank, this
/// rank's being `100·block + rank`; its gradient is `rank + 1` everywhere.
struct FakeBlock {
    block: u32,
    last: bool,
    rank: usize,
    log: Arc<Mutex<Vec<Event>>>,
    /// Fail the forward of this block (a rank dropping out of the group).
    fail_forward: bool,
    reduced: Option<Vec<f32>>,
    losses: Vec<f32>,
}

impl FakeBlock {
    fn push(&self, e: Event) {
        self.log.lock().expect("the log's lock").push(e);
    }

    fn outstanding(&self) -> usize {
        let log = self.log.lock().expect("the log's lock");
        let issued = log.iter().filter(|e| matches!(e, Event::Issue(_))).count();
        let taken = log.iter().filter(|e| matches!(e, Event::Take(..))).count();
        issued - taken
    }

    fn wire(&self, mb: u32) -> Vec<WireTensor> {
        vec![WireTensor {
            dims: vec![2],
            values: vec![mb as f32, self.block as f32],
        }]
    }
}

impl BlockStep<u32> for FakeBlock {
    fn forward(
        &mut self,
        mb: u32,
        input: BlockInput,
        items: &[u32],
    ) -> Result<Option<Vec<WireTensor>>, ExecError> {
        if self.fail_forward {
            return Err(ExecError::Unsupported(format!(
                "block {} fails",
                self.block
            )));
        }
        // The first block reads the data; every later one gets what the one before sent.
        match (self.block, input) {
            (0, BlockInput::Data) => assert_eq!(items.len(), 2),
            (b, BlockInput::Received(got)) => assert_eq!(
                got,
                vec![WireTensor {
                    dims: vec![2],
                    values: vec![mb as f32, (b - 1) as f32],
                }]
            ),
            (b, BlockInput::Data) => panic!("block {b} was handed the data"),
        }
        self.push(Event::Compute(self.block, self.outstanding()));
        if self.last {
            self.losses.push(mb as f32);
            return Ok(None);
        }
        Ok(Some(self.wire(mb)))
    }

    fn backward(
        &mut self,
        mb: u32,
        _grad_out: Option<Vec<WireTensor>>,
    ) -> Result<Vec<WireTensor>, ExecError> {
        self.push(Event::Compute(self.block, self.outstanding()));
        Ok(if self.block == 0 {
            Vec::new()
        } else {
            self.wire(mb)
        })
    }

    fn gather_plan(&self, uses: &[Option<u32>]) -> Vec<bool> {
        vec![true; uses.len()]
    }

    fn start_gather(&mut self, rank_of: (usize, usize)) -> Result<Option<Collective>, ExecError> {
        self.push(Event::Issue(self.block));
        Ok(Some(Collective::AllGather {
            shard: vec![(100 * self.block as usize + rank_of.0) as f32; SHARD],
            len: SHARD * rank_of.1,
        }))
    }

    fn finish_gather(&mut self, full: Vec<f32>) {
        self.push(Event::Take(self.block, full));
    }

    fn start_reduce(&mut self, _rank_of: (usize, usize)) -> Result<Collective, ExecError> {
        Ok(Collective::AllReduce {
            buf: vec![(self.rank + 1) as f32; SHARD],
            buckets: std::iter::once(0..SHARD).collect(),
            wire: crate::precision::Precision::F32,
        })
    }

    fn finish_reduce(
        &mut self,
        out: Vec<f32>,
        scale: f32,
        _rank_of: (usize, usize),
    ) -> Result<(), ExecError> {
        self.reduced = Some(out.into_iter().map(|g| g * scale).collect());
        Ok(())
    }

    fn reduced(&self) -> bool {
        self.reduced.is_some()
    }

    fn norm_part(&self, _tp_rank: usize) -> Option<(f64, bool)> {
        None
    }

    fn clip(&mut self, _norm: f32, _max_norm: f32) {}

    fn apply(&mut self, _replicas: Option<&mut Communicator>) -> Result<f64, ExecError> {
        Ok(0.5)
    }

    fn memory(&self) -> BlockBytes {
        BlockBytes::default()
    }

    fn take_losses(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.losses)
    }

    fn stashed(&self) -> (u32, u64) {
        (0, 0)
    }

    fn begin_step(&mut self) {
        self.reduced = None;
        self.losses.clear();
    }

    fn set_loss_scale(&mut self, _scale: f32) {}

    fn overflowed(&self) -> bool {
        false
    }
}

/// What one rank's step left: its log, each block's reduced gradient, the step's result.
struct RankRun {
    log: Vec<Event>,
    reduced: Vec<Option<Vec<f32>>>,
    result: Result<StageStepRecord, ExecError>,
}

const BLOCKS: u32 = 4;
const MICRO_BATCHES: u32 = 2;

/// One step of a block job of `BLOCKS` fake blocks on each of two ranks, `in_flight` blocks
/// gathered ahead; `fail` = (rank, block) fails that block's forward on that rank.
fn run_two_ranks(in_flight: usize, fail: Option<(usize, u32)>, timeout: Duration) -> Vec<RankRun> {
    let plan = PipelineSchedule::sequential(BLOCKS, MICRO_BATCHES).expect("a valid block job");
    let group = LocalGroup::new(
        2,
        Generation(0),
        CommConfig::default().with_timeout(timeout),
    );
    let comms = group.communicators();
    let micro_batches: Vec<Vec<u32>> = vec![vec![0, 1], vec![2, 3]];
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                let (plan, micro_batches) = (&plan, &micro_batches);
                scope.spawn(move || {
                    let log = Arc::new(Mutex::new(Vec::new()));
                    let mut chunks: Vec<Box<FakeBlock>> = (0..BLOCKS)
                        .map(|block| {
                            Box::new(FakeBlock {
                                block,
                                last: block == BLOCKS - 1,
                                rank,
                                log: log.clone(),
                                fail_forward: fail == Some((rank, block)),
                                reduced: None,
                                losses: Vec::new(),
                            })
                        })
                        .collect();
                    let stage_links = links(plan, timeout, Arc::new(AtomicBool::new(false)))
                        .into_iter()
                        .next()
                        .expect("one stage");
                    let result = run_stage_step(
                        &mut chunks,
                        StepContext {
                            schedule: plan,
                            stage: StageIndex(0),
                            links: &stage_links,
                            micro_batches,
                            replicas: Some(&mut comm),
                            model: None,
                            clip: None,
                            tp_rank: 0,
                            on_instr: &|_| {},
                            blocks_in_flight: in_flight,
                            faults: None,
                            loss_scale: None,
                        },
                    );
                    let log = log.lock().expect("the log's lock").clone();
                    RankRun {
                        log,
                        reduced: chunks.iter_mut().map(|c| c.reduced.take()).collect(),
                        result,
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank's thread ends"))
            .collect()
    })
}

/// The blocks of the list's forwards and backwards, in list order.
fn uses_in_list_order() -> Vec<u32> {
    let plan = PipelineSchedule::sequential(BLOCKS, MICRO_BATCHES).expect("a valid block job");
    plan.list(StageIndex(0))
        .iter()
        .filter(|i| i.is_compute())
        .map(|i| plan.block(StageIndex(0), i.chunk()))
        .collect()
}

#[test]
fn gathers_follow_the_list_at_most_n_ahead_and_every_n_gives_the_same_step() {
    let uses = uses_in_list_order();
    assert_eq!(uses.len() as u32, 2 * BLOCKS * MICRO_BATCHES);
    let mut first: Option<Vec<Vec<Option<Vec<f32>>>>> = None;
    for in_flight in [0, 1, 2, 3] {
        let runs = run_two_ranks(in_flight, None, Duration::from_secs(20));
        let mut reduced = Vec::new();
        for (rank, run) in runs.into_iter().enumerate() {
            let record = run.result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert_eq!(record.losses, vec![0.0, 1.0], "the last block's losses");
            // Every use gathers, in list order, each gather taken right before its use.
            let issued: Vec<u32> = run
                .log
                .iter()
                .filter_map(|e| match e {
                    Event::Issue(b) => Some(*b),
                    _ => None,
                })
                .collect();
            assert_eq!(
                issued, uses,
                "n = {in_flight}: gathers are issued in list order"
            );
            let mut computed = Vec::new();
            let mut taken: Option<(u32, &Vec<f32>)> = None;
            for event in &run.log {
                match event {
                    Event::Take(block, full) => {
                        assert!(taken.is_none(), "n = {in_flight}: two gathers for one use");
                        taken = Some((*block, full));
                    }
                    Event::Compute(block, _) => {
                        let (gathered, full) = taken
                            .take()
                            .unwrap_or_else(|| panic!("n = {in_flight}: a use without gather"));
                        assert_eq!(gathered, *block, "the gather taken is the use's block");
                        // The all-gather ran across both ranks: both shards are in the result.
                        let expect: Vec<f32> = (0..2)
                            .flat_map(|r| vec![(100 * *block as usize + r) as f32; SHARD])
                            .collect();
                        assert_eq!(full, &expect, "n = {in_flight}: block {block}'s gather");
                        computed.push(*block);
                    }
                    Event::Issue(_) => {}
                }
            }
            assert_eq!(computed, uses, "n = {in_flight}: every use took its gather");
            // EXEC-5: at most n gathered-but-unused blocks; the window is used when it can be.
            let ahead: Vec<usize> = run
                .log
                .iter()
                .filter_map(|e| match e {
                    Event::Compute(_, n) => Some(*n),
                    _ => None,
                })
                .collect();
            assert!(
                ahead.iter().all(|&a| a <= in_flight),
                "n = {in_flight}: {ahead:?}"
            );
            assert_eq!(ahead[0], in_flight.min(uses.len() - 1), "n = {in_flight}");
            assert_eq!(*ahead.last().expect("uses"), 0, "nothing is left to issue");
            reduced.push(run.reduced);
        }
        // The gradients were summed over the two ranks ((1 + 2) everywhere) and scaled by
        // 1 / (M · world); bitwise the same for every n (OVL-1).
        let scale = 1.0 / (MICRO_BATCHES as usize * 2) as f32;
        for blocks in &reduced {
            for r in blocks {
                assert_eq!(r.as_deref(), Some(&[3.0 * scale; SHARD][..]));
            }
        }
        match &first {
            None => first = Some(reduced),
            Some(f) => assert_eq!(f, &reduced, "n = {in_flight} changed the step"),
        }
    }
}

#[test]
fn a_rank_dropping_out_fails_the_next_collective_named_with_its_block() {
    // Rank 1 fails block 2's forward of micro-batch 0: rank 0's gather for block 3 has no
    // partner and times out. In place (n = 0) that is exactly the gather of block 3.
    let runs = run_two_ranks(0, Some((1, 2)), Duration::from_millis(300));
    match &runs[1].result {
        Err(ExecError::Unsupported(what)) => assert!(what.contains("block 2"), "{what}"),
        other => panic!("rank 1 failed its own block: {other:?}"),
    }
    match &runs[0].result {
        Err(ExecError::BlockCollective {
            stage: 0,
            block: 3,
            op: CollectiveKind::AllGather,
            ..
        }) => {}
        other => panic!("rank 0 names block 3's all-gather: {other:?}"),
    }
    let message = runs[0].result.as_ref().expect_err("failed").to_string();
    assert!(message.contains("block 3"), "{message}");
    // With gathers in flight the failure is still named with a block and the op, within
    // the bound (OVL-2), never a hang.
    let runs = run_two_ranks(1, Some((1, 2)), Duration::from_millis(300));
    match &runs[0].result {
        Err(
            ExecError::BlockCollective { block, op, .. }
            | ExecError::BlockCollectiveTimeout { block, op, .. },
        ) => {
            assert!(*block >= 3, "a gather after rank 1 left: block {block}");
            assert_eq!(*op, CollectiveKind::AllGather);
        }
        other => panic!("rank 0 names the failed gather: {other:?}"),
    }
}
