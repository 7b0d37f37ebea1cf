#!/bin/bash
# Final device call of the session: new GPU tests (+ sanitizers), then benches, each
# phase under its own time limit; everything lands in $OUT/all.tgz.
OUT=${1:?OUT}
T0=$SECONDS
python3 -m tarfile -e target/gpu-bundle.tar.xz target/ || exit 1
B=$PWD/target/gpu-bundle
export NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.txt 2>&1
( cd $B && WARPDRIVE_RELEASE_AT_EXIT=1 timeout ${TESTS_S:-150} bash run.sh $R/tests --tests --sanitize --only ${ONLY:-dist_symmetric,agents} ) > $R/tests.log 2>&1
echo "tests done at $((SECONDS-T0)) s" >> $R/phases.txt
cd $B
export XDG_CACHE_HOME=/tmp/wd-bench-cache; rm -rf $XDG_CACHE_HOME; mkdir -p $XDG_CACHE_HOME
for spec in ${BENCHES:-"agents:full:90" "dist:quick:120"}; do
  IFS=: read -r suite scale limit <<<"$spec"
  timeout $limit ./warpdrive bench $suite --scale $scale --json $R/$suite.json > $R/bench-$suite.log 2>&1
  echo "bench $suite rc=$? at $((SECONDS-T0)) s" >> $R/phases.txt
done
[ -n "$EXTRA" ] && (cd $OLDPWD && timeout ${EXTRA_S:-120} bash -c "$EXTRA") > $R/extra.log 2>&1
echo "all done at $((SECONDS-T0)) s" >> $R/phases.txt
tar czf $OUT/all.tgz -C $OUT r
