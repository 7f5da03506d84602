#!/usr/bin/env bash
# meshwork beside PyTorch on this machine, in one run: each pair runs back to back, so the
# ratios hold for the same load. Needs a Python with torch (CPU wheel from PyPI is enough) and
# OpenMPI's mpirun is not needed.
#
#   cargo build --release --features cluster --bin meshwork
#   benches/peers/compare.sh /path/to/python [target/release/meshwork]
#
# 1. one GPT layer per core: `meshwork bench layer --pytorch` (gpt_layer.py inside it);
# 2. the all-reduce over loopback TCP at 16 MiB, 2 and 4 processes: `meshwork bench allreduce
#    --transport tcp` beside gloo_allreduce.py;
# 3. data parallelism on the MLP 784-1024-1024-10, 2 processes/replicas: `meshwork bench dp`
#    beside ddp_mlp.py (DDP over gloo);
# 4. the demo GPT end to end, two sizes, dp 1 and 2: `meshwork bench gpt --pytorch`
#    (`meshwork train --model gpt` beside gpt_ddp.py: the same model, data order and Adam,
#    DDP over gloo; windows/s, validation loss, FLOP/s per core).
set -euo pipefail
python=${1:?usage: compare.sh PYTHON [MESHWORK]}
meshwork=${2:-target/release/meshwork}
here=$(cd "$(dirname "$0")" && pwd)

echo "== one GPT layer, one core"
taskset -c 0 "$meshwork" bench layer --pytorch "$python"

for world in 2 4; do
  echo "== all-reduce 16 MiB over loopback TCP, $world processes"
  "$meshwork" bench allreduce --transport tcp --world "$world" --bytes 16MiB --json
  "$python" "$here/gloo_allreduce.py" --world "$world" --bytes 16777216
done

echo "== data parallelism, MLP 784-1024-1024-10, batch 64 per replica, 2 replicas"
"$meshwork" bench dp --world 2 --json
"$python" "$here/ddp_mlp.py" --world 2

echo "== the demo GPT end to end, two sizes, dp 1 and 2 (gpt_ddp.py inside it)"
"$meshwork" bench gpt --pytorch "$python"
