#!/bin/bash
# Device call 4 (eighth session): device-launch tests (+ memcheck) and suite after the chained
# dispatcher; the CPU process group's all-reduce on lent buffers (16 cores).
OUT=${1:?OUT}
T0=$SECONDS
R=$OUT/r; mkdir -p $R
pack() { echo "$1 at $((SECONDS-T0)) s" >> $R/phases.txt; tar czf $OUT/all.tgz -C $OUT r 2>/dev/null; }
python3 -m tarfile -e target/gpu-bundle.tar.xz target/ 2>/dev/null || exit 1
B=$PWD/target/gpu-bundle
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
nproc >> $R/gpu.txt; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled >> $R/gpu.txt 2>&1
pack unpacked
cd $B
WARPDRIVE_RELEASE_AT_EXIT=1 timeout 150 bash run.sh $R/tests --tests --sanitize --only device_launch,dist_procs > $R/tests.log 2>&1
pack "tests+sanitize rc=$?"
export XDG_CACHE_HOME=/tmp/wd-bench-cache; rm -rf $XDG_CACHE_HOME; mkdir -p $XDG_CACHE_HOME
timeout 150 ./warpdrive bench device-launch --scale full --json $R/device-launch.json > $R/bench-dl.log 2>&1
pack "bench device-launch rc=$?"
timeout 120 ./warpdrive bench dist --device cpu --json $R/dist-cpu.json > $R/bench-dist-cpu.log 2>&1
pack "bench dist cpu rc=$?"
timeout 60 ./examples/procs_all_reduce 4 256 10 > $R/procs-lend.log 2>&1
pack "procs lend rc=$?"
WARPDRIVE_DIST_LEND=0 timeout 60 ./examples/procs_all_reduce 4 256 10 > $R/procs-nolend.log 2>&1
pack "procs nolend rc=$?"
