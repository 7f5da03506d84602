//! CI-1: the library's compiled demo jobs (`testing::instances`) are ordinary functions: each
//! trains its job exactly as `build → spawn → join` does (bitwise), on the devices it asks
//! for.

use std::sync::Arc;
use std::time::Duration;

use burn::optim::SgdConfig;
use burn::tensor::Device;
use meshwork::data::TextWindows;
use meshwork::demo::gpt::{Gpt, GptConfig};
use meshwork::demo::{MlpStage, mlp_pipeline};
use meshwork::prelude::*;
use meshwork::testing::instances::{run_gpt, run_mlp, run_stages};
use meshwork::testing::{
    TeacherFixture, bounded, compare_parameters, draw_lock, final_fingerprints,
};

const BOUND: Duration = Duration::from_secs(120);

fn fixture() -> TeacherFixture {
    TeacherFixture::new(4, 1)
        .with_widths(&[4, 8, 2])
        .with_samples(64)
}

/// The same job through the plain API: its trained model.
async fn plain<M: Send + 'static, I: Send + Sync + 'static>(builder: JobBuilder<M, I>) -> M {
    let job = builder.build().expect("the job builds");
    let handle = job.spawn().await.expect("the job starts");
    handle.join().await.expect("the job trains").model
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ci_1_the_compiled_mlp_job_trains_as_the_plain_one_on_two_replicas() {
    let f = fixture();
    let init = f.initial_model();
    let job = || {
        f.builder(&init, 2, 16, 4)
            .optimizer(SgdConfig::new())
            .learning_rate(0.1)
    };
    let (outcome, events) = bounded(BOUND, run_mlp(job())).await;
    let trained = outcome.expect("the job trains").model;
    assert_eq!(final_fingerprints(&events).map(|f| f.len()), Some(2));
    let reference = bounded(BOUND, plain(job())).await;
    compare_parameters(&trained, &reference, 0.0).expect("bitwise equal");
    compare_parameters(&trained, &init, 0.0).expect_err("it trained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ci_1_the_compiled_stage_jobs_train_as_the_plain_ones_in_two_stages() {
    let f = fixture();
    let stages = || {
        let _draw = draw_lock();
        let device = Device::flex();
        device.seed(3);
        mlp_pipeline(&[4, 8, 8, 2], &[1, 2], &device).expect("two stages")
    };
    let job = || {
        Job::builder()
            .data(f.data())
            .batch_size(16)
            .steps(3)
            .optimizer(SgdConfig::new())
            .learning_rate(0.1)
    };
    let schedule = Schedule::OneFOneB { micro_batches: 2 };
    let (outcome, events) = bounded(BOUND, run_stages(job(), stages(), Some(schedule))).await;
    let mut trained = outcome.expect("the pipeline trains").model;
    assert_eq!(final_fingerprints(&events).map(|f| f.len()), Some(2));
    let mut reference = bounded(BOUND, plain(job().pipeline(stages(), schedule))).await;
    assert_eq!(trained.len(), 2);
    for i in 0..trained.len() {
        let (a, b) = (
            trained.take_block::<MlpStage>(i).expect("a block"),
            reference.take_block::<MlpStage>(i).expect("a block"),
        );
        compare_parameters(&a, &b, 0.0).expect("bitwise equal");
    }

    let config = GptConfig {
        vocab: 11,
        context: 4,
        d_model: 8,
        heads: 2,
        layers: 1,
    };
    let gpt = || {
        let _draw = draw_lock();
        let device = Device::flex();
        device.seed(5);
        Gpt::new(&config, &device)
    };
    let tokens: Arc<[u32]> = (0..200u32).map(|i| (i * 7 + i / 5) % 11).collect();
    let text = || {
        Job::builder()
            .data(TextWindows::new(tokens.clone(), 4, 4).expect("windows"))
            .tensor_parallel(2)
            .batch_size(4)
            .steps(3)
            .optimizer(SgdConfig::new())
            .learning_rate(0.1)
    };
    let (outcome, events) = bounded(BOUND, run_gpt(text(), gpt(), None, None)).await;
    let trained = Gpt::from_blocks(outcome.expect("the GPT trains").model).expect("a GPT");
    assert_eq!(final_fingerprints(&events).map(|f| f.len()), Some(2));
    let reference = bounded(BOUND, plain(text().blocks(gpt().into_blocks()))).await;
    let reference = Gpt::from_blocks(reference).expect("a GPT");
    compare_parameters(&trained, &reference, 0.0).expect("bitwise equal");
    compare_parameters(&trained, &gpt(), 0.0).expect_err("it trained");
}
