#!/usr/bin/env bash
# Session 34 call 1: merge variants timed; Nsight Compute on the tree's merge at both shapes
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 520 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
export PYTHONUNBUFFERED=1
timeout $(left 240) python3 .gpu/m1.py 2>&1 | tee $OUT/m1.txt
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
for s in qwen2.5-0.5b qwen3-4b; do
  NCU=$s timeout $(left 90) ncu --clock-control none $SEC -k regex:_merge_table_kernel --launch-skip 2 --launch-count 1 python3 .gpu/m1.py > $OUT/ncu_$s.txt 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit|Shared Memory|Warp Cycles Per Issued|Theoretical Occupancy|Stall|Issued Warp|No Eligible|Active Warps Per|L1/TEX Hit|L2 Hit|Compute \(SM\)|Local" $OUT/ncu_$s.txt | head -40
done
date -u
