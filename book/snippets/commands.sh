# the main job: a demo MLP, one replica per core, progress bar and report
cargo run --release -- train --steps 100
# ANCHOR: save-model
# two replicas, global batch 128, then save the trained model
cargo run --release -- train --dp 2 --batch-size 128 --steps 50 --save-model demo-model.bpk
# ANCHOR_END: save-model
# the same model cut into two pipeline stages (1F1B), with a picture of the last step
cargo run --release -- train --pp 2 --micro-batches 4 --steps 20 --timeline pipeline.svg
# two replicas of a two-stage interleaved pipeline (2 × 2 devices, 2 chunks per stage)
cargo run --release -- train --pp 2 --dp 2 --schedule interleaved --virtual-stages 2 --micro-batches 4 --steps 20
# ANCHOR: gpt
# the small GPT on the King James Bible, each layer split over two devices; 60 characters sampled at the end
cargo run --release -- train --model gpt --tp 2 --steps 30 --sample 60
# ANCHOR_END: gpt
# ANCHOR: recipe
# the recipe: 2 replicas × 2 pipeline stages × 2 tensor-parallel ranks, ZeRO-1, bf16, clipping, accumulation, warm-up/cosine
cargo run --release -- train --model gpt --dp 2 --pp 2 --tp 2 --zero 1 --precision bf16 --clip 1.0 --accumulate 2 --lr-schedule warmup-cosine --steps 20 --sample 60
# ANCHOR_END: recipe
# ANCHOR: recipe-resume
# stop a dp 2 × tp 2 GPT after 10 steps with a checkpoint, then resume it on one replica of 4 tensor-parallel ranks
cargo run --release -- train --model gpt --dp 2 --tp 2 --zero 1 --steps 10 --checkpoint-dir gpt-checkpoints
cargo run --release -- train --model gpt --dp 1 --tp 4 --zero 1 --steps 20 --checkpoint-dir gpt-checkpoints --resume
# ANCHOR_END: recipe-resume
# ANCHOR: job-file
# the recipe's job as a file: write it, run it (a flag overrides its key), or run the plan's best layout
cargo run --release -- train --model gpt --dp 2 --pp 2 --tp 2 --zero 1 --precision bf16 --clip 1.0 --accumulate 2 --lr-schedule warmup-cosine --steps 20 --print-config
cargo run --release -- train --config book/snippets/recipe.toml --steps 4
cargo run --release -- plan --model gpt --devices 2 --batch 8 --steps 3 --emit-config layout.toml
cargo run --release -- train --config layout.toml
# ANCHOR_END: job-file
# ANCHOR: faults
# a fault-injection run: four replicas, a kill and a panic from the plan, shrinking to the survivors;
# the dropped message is found by the collective time-out (2 s), and the plan's four recoveries
# within a minute need --max-restarts above the default 3
cargo run --release -- train --dp 4 --batch-size 48 --steps 20 --faults book/snippets/faults.json --on-replica-loss shrink --collective-timeout 2 --max-restarts 5
# ANCHOR_END: faults
# ANCHOR: slow-links
# the methods for slow networks, in miniature: 4 ranks, 100 MB/s links with 2 ms latency, then one rank 3× slower
cargo run --release -- bench comm-efficiency --steps 16 --hidden 64 --slow-rank-batch-size 256 --methods bf16,diloco,ssp-2,backup
# ANCHOR_END: slow-links
# ANCHOR: bench
# collective bandwidth (algbw, busbw) against memcpy, one size, as JSON
cargo run --release -- bench allreduce --world 2 --bytes 16MiB --algo direct --json
# data-parallel weak scaling against a plain Burn loop, the serial fraction and Amdahl's curve
cargo run --release -- bench dp --world 2 --steps 5 --svg scaling.svg
# the control plane at more ranks: a tiny model on 8 and 32 logical ranks, and the recovery decision at 16,384
cargo run --release -- bench scale --ranks 8,32 --steps 2
# a two-stage pipeline (1F1B, 4 micro-batches): samples/s, measured vs theoretical bubble
cargo run --release -- bench pipeline --pp 2 --micro-batches 4 --schedule 1f1b --hidden 64 --steps 2 --json
# the same with interleaved 1F1B (2 chunks per stage), layers cut by count
cargo run --release -- bench pipeline --pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2 --split even --hidden 64 --steps 2
# one GPT layer per core: a meshwork job, a plain Burn loop and the backend's matmul bound
cargo run --release -- bench layer --hidden 64 --heads 4 --seq 8 --batch 2 --steps 3 --repeats 1 --json
# one optimizer step per parameter: Burn's and meshwork's flat rule against a memcpy
cargo run --release -- bench optimizer --width 64 --steps 2 --json
# the demo GPT end to end at dp 1 and 2: windows/s, validation loss, FLOP/s per core (--pytorch PY: beside PyTorch DDP)
cargo run --release -- bench gpt --sizes small --steps 4 --json
# ANCHOR_END: bench
# ANCHOR: plan
# every layout of the recipe's GPT over 2 devices, ranked by predicted step time, the fastest run to check
cargo run --release -- plan --model gpt --layers 1 --hidden 16 --heads 2 --seq 8 --batch 4 --devices 2 --top 4 --check 1 --steps 3
# the demo MLP, as JSON lines
cargo run --release -- plan --model mlp --hidden 32 --depth 2 --batch 8 --devices 2 --json
# ANCHOR_END: plan
