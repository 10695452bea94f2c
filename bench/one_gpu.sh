#!/bin/bash
# Our collectives against JAX's multihost_utils on GPU arrays, on a machine
# with one GPU: 2 (then 4) controllers share it, each its own "host" to NCCL.
#
#   bash bench/one_gpu.sh [OUT_DIR]       # MPS=1 bash bench/one_gpu.sh: see below
#
# NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected").
# Each controller gets its own NCCL_HOSTID, so NCCL takes them for separate
# hosts and connects them with its socket transport over loopback, as hosts
# without NVLink or RDMA would be. With MPS=1, CUDA's multi-process service
# runs so that the controllers' kernels run at once rather than in turns
# (without it, every device collective pays for the GPU's time slices).
# The launcher asks for CPU devices (JAX_PLATFORMS=cpu); each controller's
# command puts the GPU back (JAX_PLATFORMS=cuda,cpu, JAX_LOCAL_DEVICE_IDS=0).
# Every case runs with each transport choice: auto (TCP up to 1 MiB, the
# device collective above), tcp and device (MULTIHOST_TRANSPORT).
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/multihost-one-gpu}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_DEBUG=WARN
python=${PYTHON:-python3}
date -u; nvidia-smi -L; nproc; uptime
$python -c 'import jax; print("jax", jax.__version__, jax.devices())'
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d || exit 1
  trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
  echo "MPS started"
fi
run() {  # P transport(auto|tcp|device) sizes repeats small_repeats timeout [tag]
  local tag=${7:-p$1_$2}
  local t=""; [ "$2" != auto ] && t="MULTIHOST_TRANSPORT=$2"
  local s=$(date +%s)
  env $t timeout $6 $python -m multihost.launch --num_processes=$1 -- bash -c \
    "NCCL_HOSTID=host\$JAX_PROCESS_ID JAX_PLATFORMS=cuda,cpu JAX_LOCAL_DEVICE_IDS=0 exec $python bin/bench.py --ops=broadcast_one_to_all,process_allgather --sizes=$3 --inputs=device --leaves=0 --repeats=$4 --small_repeats=$5 --json=$out/$tag.json" \
    > "$out/$tag.log" 2>&1
  local rc=$?
  echo "== P=$1 transport=$2 rc=$rc $(( $(date +%s) - s )) s, load $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -E '^\[p0\] \| (broadcast|process)' "$out/$tag.log"
  return $rc
}
run 2 auto 8,2MiB 3 3 150 probe || { tail -60 "$out/probe.log"; exit 1; }
rm -f "$out/probe.json" "$out/probe.log"
run 2 auto 8,64KiB,256KiB,1MiB,2MiB,8MiB,64MiB 11 31 150
run 2 tcp 256KiB,1MiB,2MiB,8MiB,64MiB 11 31 120
run 2 device 8,256KiB,1MiB,2MiB,8MiB,64MiB 11 31 120
run 4 auto 8,1MiB,2MiB,64MiB 9 21 150
date -u
