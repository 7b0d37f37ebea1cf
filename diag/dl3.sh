#!/bin/bash
# Device call 3 (eighth session): device-launch (chained dispatcher) and agents (vote, averaging)
# tests with sanitizers, then both suites.
OUT=${1:?OUT}
T0=$SECONDS
R=$OUT/r; mkdir -p $R
pack() { echo "$1 at $((SECONDS-T0)) s" >> $R/phases.txt; tar czf $OUT/all.tgz -C $OUT r 2>/dev/null; }
python3 -m tarfile -e target/gpu-bundle.tar.xz target/ 2>/dev/null || exit 1
B=$PWD/target/gpu-bundle
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
pack unpacked
cd $B
WARPDRIVE_RELEASE_AT_EXIT=1 timeout 200 bash run.sh $R/tests --tests --sanitize --only device_launch,agents > $R/tests.log 2>&1
pack "tests+sanitize rc=$?"
export XDG_CACHE_HOME=/tmp/wd-bench-cache; rm -rf $XDG_CACHE_HOME; mkdir -p $XDG_CACHE_HOME
timeout 150 ./warpdrive bench device-launch --scale full --json $R/device-launch.json > $R/bench-dl.log 2>&1
pack "bench device-launch rc=$?"
timeout 90 ./warpdrive bench agents --scale full --json $R/agents.json > $R/bench-agents.log 2>&1
pack "bench agents rc=$?"
