#!/bin/bash
# Final device call of the session: the new GPU tests (+ sanitizers), then benches, each
# phase under its own limit; the results are packed into $OUT/all.tgz after every phase.
OUT=${1:?OUT}
T0=$SECONDS
R=$OUT/r; mkdir -p $R
pack() { echo "$1 at $((SECONDS-T0)) s" >> $R/phases.txt; tar czf $OUT/all.tgz -C $OUT r 2>/dev/null; }
python3 -m tarfile -e target/gpu-bundle.tar.xz target/ || exit 1
B=$PWD/target/gpu-bundle
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
pack unpacked
cd $B
WARPDRIVE_RELEASE_AT_EXIT=1 timeout 150 bash run.sh $R/tests --tests --sanitize --only dist_symmetric,agents > $R/tests.log 2>&1
pack "tests+sanitize rc=$?"
timeout 25 ./tests/permute --include-ignored scan --test-threads=1 > $R/permute.log 2>&1
pack "permute rc=$?"
timeout 30 ./tests/dist --include-ignored hierarchy_by_host --test-threads=1 > $R/dist-hier.log 2>&1
pack "dist hierarchy rc=$?"
export XDG_CACHE_HOME=/tmp/wd-bench-cache; rm -rf $XDG_CACHE_HOME; mkdir -p $XDG_CACHE_HOME
timeout 80 ./warpdrive bench agents --scale full --json $R/agents.json > $R/bench-agents.log 2>&1
pack "bench agents rc=$?"
timeout 75 ./warpdrive bench dist --scale quick --json $R/dist.json > $R/bench-dist.log 2>&1
pack "bench dist rc=$?"
timeout 90 ./warpdrive bench serve --scale quick --json $R/serve.json > $R/bench-serve.log 2>&1
pack "bench serve rc=$?"
