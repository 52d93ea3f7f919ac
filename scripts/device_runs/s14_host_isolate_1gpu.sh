#!/usr/bin/env bash
# Run s14-2 (benchmarks/results/README.md): run s14-1 showed the #51 tree's host times ~30-40%
# above the tree before it, graph launches included (which run none of the changed code). This
# separates the suspects, alternating one process per variant, ROUNDS rounds:
#   base     the tree before #51 (.carry/base, its own ABI-7 library)
#   new      this tree
#   nocache  this tree with a MOK_CACHE_SMEM_GRANTS=0 build (.carry/lib_nocache)
#   cvp      this tree's library with a copy of its package whose pointers go to ctypes as
#            c_void_p objects, as before #51 (.carry/new_cvp)
# Each process first times work that is the same in every tree (process probes).
C=${1:?commit}
ROUNDS=${2:-2}
. "$(dirname "$0")/common.sh"
for i in $(seq 1 $ROUNDS); do
  for v in base new nocache cvp; do
    root=.; lib=
    case $v in base) root=.carry/base ;; nocache) lib=$PWD/.carry/lib_nocache/libmok_cuda.so ;; cvp) root=.carry/new_cvp ;; esac
    MOK_CUDA_LIB=$lib timeout -k 5 90 python3 scripts/profile_host_calls.py --out $R/host_${v}_$i --root $root \
      --tag $v --commit $C --tokens 128,512 > $R/host_${v}_$i.log 2>&1
    echo "[host $v $i] rc=$?"; grep -E "^T=|probes|Error" $R/host_${v}_$i.log
  done
done
cd $OUT && tar czf r.tgz r && rm -rf r
