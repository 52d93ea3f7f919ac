#!/usr/bin/env bash
# Run s14-3 (benchmarks/results/README.md): s14-2's process probes showed the host's speed
# varying up to 2.3x between processes (a pure-Python loop 2.9-6.9 us), enough to swamp an A/B
# of host paths. So every process here is pinned to one core (taskset, the same for all), and
# #51 is A/B'd against the tree before it (.carry/base) in ROUNDS alternating rounds. Then the
# small-batch tool (on 4 cores: loopback ranks are threads), whose graph columns now start on a
# busy GPU (NOTES (KK)).
C=${1:?commit}
ROUNDS=${2:-4}
CORE=${CORE:-6}
. "$(dirname "$0")/common.sh"
PIN=; command -v taskset > /dev/null && PIN="taskset -c $CORE"
echo "pinned with: ${PIN:-nothing (no taskset)}"
for i in $(seq 1 $ROUNDS); do
  for v in base new; do
    root=.; [ $v = base ] && root=.carry/base
    timeout -k 5 90 $PIN python3 scripts/profile_host_calls.py --out $R/host_${v}_$i --root $root \
      --tag $v --commit $C --tokens 128,512 > $R/host_${v}_$i.log 2>&1
    echo "[host $v $i] rc=$?"; grep -E "^T=|probes|Error" $R/host_${v}_$i.log
  done
done
timeout -k 5 120 ${PIN:+taskset -c 4-7} python3 benchmarks/bench_small_batch.py --out $R/small --commit $C --tokens 128,512 --worlds 1,2 > $R/small.log 2>&1
echo "[small] rc=$?"; grep "^| " $R/small.log
cd $OUT && tar czf r.tgz r && rm -rf r
