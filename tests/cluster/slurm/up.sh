#!/usr/bin/env bash
# Starts a one-machine Slurm cluster (munged, slurmctld, slurmd) whose every file lives under
# DIR, for tests/cluster/cluster_slurm.rs: `up.sh DIR CTLD_PORT SLURMD_PORT`. Prints the
# slurm.conf path once the node is idle; `down.sh DIR` stops it. Needs slurm-wlm and munge
# (`.ci/run` installs them) and root (the daemons run as root, munged with --force).
set -euo pipefail
DIR="$1"; CTLD_PORT="$2"; SLURMD_PORT="$3"
mkdir -p "$DIR"/{state,spool,log,munge}
chmod 700 "$DIR/munge"
HOST="$(hostname -s)"
CPUS="$(nproc)"

# munge: a fresh key, its own socket, pid and log.
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$DIR/munge/munge.key"
munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/socket" \
  --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
  --seed-file="$DIR/munge/seed"

cat > "$DIR/slurm.conf" <<CONF
ClusterName=meshwork-test
SlurmctldHost=$HOST
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
MaxJobCount=1000
KillWait=5
InactiveLimit=0
MinJobAge=300
NodeName=$HOST CPUs=8 State=UNKNOWN
PartitionName=test Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF="$DIR/slurm.conf"
slurmctld -i -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 120); do
  if sinfo -h -o '%T' 2>/dev/null | grep -qx idle; then
    echo "$SLURM_CONF"
    exit 0
  fi
  sleep 0.5
done
echo "the Slurm node never became idle:" >&2
sinfo >&2 || true
tail -n 30 "$DIR"/log/*.log >&2 || true
exit 1
