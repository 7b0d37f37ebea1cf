#!/bin/bash
# Second device call: agents' GPU tests (+ sanitizers) after the averaging and barrier
# changes, the agents suite, and the tier suite on the GPU host.
OUT=${1:?OUT}
T0=$SECONDS
R=$OUT/r; mkdir -p $R
pack() { echo "$1 at $((SECONDS-T0)) s" >> $R/phases.txt; tar czf $OUT/all.tgz -C $OUT r 2>/dev/null; }
python3 -m tarfile -e target/gpu-bundle.tar.xz target/ 2>/dev/null || exit 1
B=$PWD/target/gpu-bundle
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
cd $B
WARPDRIVE_RELEASE_AT_EXIT=1 timeout 80 bash run.sh $R/tests --tests --sanitize --only agents > $R/tests.log 2>&1
pack "tests+sanitize rc=$?"
export XDG_CACHE_HOME=/tmp/wd-bench-cache; rm -rf $XDG_CACHE_HOME; mkdir -p $XDG_CACHE_HOME
timeout 60 ./warpdrive bench agents --scale full --json $R/agents.json > $R/bench-agents.log 2>&1
pack "bench agents rc=$?"
timeout 150 ./warpdrive bench tier --scale full --json $R/tier.json > $R/bench-tier.log 2>&1
pack "bench tier rc=$?"
