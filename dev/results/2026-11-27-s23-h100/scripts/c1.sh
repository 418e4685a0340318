#!/usr/bin/env bash
# Session 23, call 1: Nsight Compute on one Qwen2.5-0.5B rollout's kernels (the decoding GEMMs, the attention, the
# merge, the LM head and the sampler), to find what holds the big GEMMs and the merge under the bandwidth.
set -uo pipefail
R=$PWD
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
which ncu; ncu --version | tail -1
timeout $(left 150) python3 .gpu/ncuroll.py --tokenizer .gpu/tok 2>&1 | tail -2
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section SourceCounters"
run() {  # name regex skip count
  timeout $(left 150) ncu --clock-control none --profile-from-start off --cache-control all $SEC \
    -k regex:"$2" --launch-skip $3 --launch-count $4 python3 .gpu/ncuroll.py --tokenizer .gpu/tok > $OUT/ncu_$1.txt 2>&1
  tail -2 $OUT/ncu_$1.txt
}
run layers "_decode_" 1205 10      # the 10th decoding step's layers 2-3 (5 launches a layer)
run merge "_merge_table" 0 1
run head "nvjet|gemm|gemv|_sample_" 40 6
for f in $OUT/ncu_*.txt; do
  grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Block Limit|Waves Per SM|Grid Size|Block Size|Shared Memory Config|Dynamic Shared|Warp Cycles Per Issued|Theoretical Occupancy|Stall|Issued Warp|No Eligible|Active Warps Per" $f > ${f%.txt}.short
done
wc -l $OUT/*
date -u
