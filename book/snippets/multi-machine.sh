#!/bin/bash
# Commands of the "Running on several machines" chapter (checked with `bash -n`, and every
# flag against `meshwork <command> --help`).
# ANCHOR: secret
# once, on a shared file system: a long random secret only you can read
mkdir -p ~/.meshwork && (umask 077; head -c 32 /dev/urandom | base64 > ~/.meshwork/secret)
# in every shell that starts a meshwork process of the job
export MESHWORK_SECRET_FILE=~/.meshwork/secret
# ANCHOR_END: secret
# ANCHOR: head
# on the head host: listen on every interface, wait up to 2 minutes for two nodes, train the
# demo MLP on their ranks for 200 steps and write the trained model here
meshwork train --listen 0.0.0.0:29500 --nodes 2 --job demo --join-timeout 120 --steps 200 --save-model demo.bpk
# ANCHOR_END: head
# ANCHOR: nodes
# on each node host: join the head, holding two devices
meshwork node --join head-host:29500 --job demo --local-devices 2
# ANCHOR_END: nodes
# ANCHOR: head-device
# the head may hold devices too: then say which of its addresses the nodes reach it at
meshwork train --listen 0.0.0.0:29500 --nodes 2 --job demo --local-devices 1 --data-host 10.0.0.1
# ANCHOR_END: head-device
# ANCHOR: dry-run
# assemble the world, prepare every node, then stop them all without training: a check that
# every host can reach the head and the others' data-plane ports
meshwork train --listen 0.0.0.0:29500 --nodes 2 --job demo --dry-run
# ANCHOR_END: dry-run
# ANCHOR: torchrun
# torchrun-style variables instead of flags: process 0 is the head (holding one device),
# every other process a node with one device
RANK=0 WORLD_SIZE=3 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 meshwork train --job demo
RANK=1 WORLD_SIZE=3 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 meshwork node --job demo
RANK=2 WORLD_SIZE=3 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 meshwork train --job demo
# ANCHOR_END: torchrun
# ANCHOR: mpirun
# OpenMPI's mpirun (or MPICH's mpiexec): rank 0 is the head (holding one device), every other
# rank a node with one device; across hosts, name rank 0's host (on one host it is this one)
mpirun -n 4 -x MESHWORK_SECRET_FILE -x MASTER_ADDR=10.0.0.1 meshwork train --job demo
# ANCHOR_END: mpirun
# ANCHOR: mpi
# the same job with its bytes through MPI (meshwork built with --features mpi): MPI itself says
# who is rank 0 and where it runs, and rank 0 picks the port, so nothing but the secret is set
mpirun -n 4 -x MESHWORK_SECRET_FILE meshwork train --transport mpi --job demo
# a dp 2 x pp 2 x tp 2 GPT on four processes of two devices each
mpirun -n 4 -x MESHWORK_SECRET_FILE meshwork train --transport mpi --local-devices 2 --model gpt --pp 2 --tp 2
# under Slurm, on the MPI transport (Slurm's PMIx plugin starts OpenMPI's ranks)
srun --mpi=pmix -n 4 meshwork train --transport mpi --job demo
# ANCHOR_END: mpi
# ANCHOR: pipeline
# a 2 × 2 dp × pp job: the head waits for four nodes, each will hold one pipeline stage
meshwork train --listen 0.0.0.0:29400 --nodes 4 --pp 2 --schedule 1f1b --micro-batches 4 --save-model trained.bpk
# on each of the four node hosts
meshwork node --join head-host:29400
# ANCHOR_END: pipeline
# ANCHOR: tensor
# a 2 × 2 × 2 dp × pp × tp job of the demo GPT: four nodes of two devices each (each node's
# two ranks are one tensor-parallel pair), the trained GPT's slices put together on the head
meshwork train --listen 0.0.0.0:29400 --nodes 4 --model gpt --pp 2 --tp 2 --layers 1 --save-model gpt.bpk
# on each of the four node hosts
meshwork node --join head-host:29400 --local-devices 2
# ANCHOR_END: tensor
# ANCHOR: recipe
# the transformer recipe (dp 2 x pp 2 x tp 2, ZeRO-1, bf16, clipping, accumulation, warm-up and
# cosine) as one file, written once
meshwork train --model gpt --dp 2 --pp 2 --tp 2 --zero 1 --precision bf16 --clip 1.0 --accumulate 2 --lr-schedule warmup-cosine:2 --print-config > recipe.toml
# on the head host: the file is the whole job; the nodes get it from the head
meshwork train --listen 0.0.0.0:29400 --nodes 4 --config recipe.toml --save-model gpt.bpk
# on each of the four node hosts, two devices each (one tensor-parallel pair)
meshwork node --join head-host:29400 --local-devices 2
# or the same file under mpirun, on the MPI transport (meshwork built with --features mpi)
mpirun -n 4 -x MESHWORK_SECRET_FILE meshwork train --transport mpi --local-devices 2 --config recipe.toml
# ANCHOR_END: recipe
# ANCHOR: tls-certs
# once, on a trusted machine: a certificate authority for the cluster (ca.key never leaves it) ...
(umask 077; openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out ca.key)
openssl req -x509 -new -key ca.key -subj "/CN=meshwork CA" -days 365 -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.pem
# ... and the head's key and certificate, for the name nodes join it by (here head-host)
(umask 077; openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out head.key)
openssl req -new -key head.key -subj "/CN=head-host" -out head.csr
printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" "subjectAltName=DNS:head-host" > head.ext
openssl x509 -req -in head.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 -extfile head.ext -out head.pem
# head.pem and head.key go to the head host, ca.pem to every node host
# ANCHOR_END: tls-certs
# ANCHOR: tls
# TLS on the control plane: the head presents a certificate for the name nodes join it by ...
meshwork train --listen 0.0.0.0:29500 --nodes 2 --job demo --tls-cert head.pem --tls-key head.key
# ... and each node trusts the authority that signed it (and checks the name: head-host)
meshwork node --join head-host:29500 --job demo --tls-ca ca.pem
# ANCHOR_END: tls
# ANCHOR: join
# while a data-parallel job runs: one more node joins it and becomes new replicas
meshwork node --join head-host:29500 --job demo
# ANCHOR_END: join
