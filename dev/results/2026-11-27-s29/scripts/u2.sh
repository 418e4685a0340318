#!/usr/bin/env bash
# Session 29 call: adapter_grads loop variants timed; Nsight Compute on the tree's kernel and variant v1
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 480 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 150) python3 .gpu/agv.py 2>&1 | tee $OUT/agv.txt
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
for v in v0 v1 v2; do
  NCU=$v timeout $(left 100) ncu --clock-control none $SEC -k regex:_adapter_grads_kernel --launch-skip 2 --launch-count 1 python3 .gpu/agv.py > $OUT/ncu_$v.txt 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit|Dynamic Shared|Warp Cycles Per Issued|Theoretical Occupancy|Stall|Issued Warp|No Eligible|Active Warps Per|L1/TEX Hit|L2 Hit|Compute \(SM\)" $OUT/ncu_$v.txt > $OUT/ncu_$v.short; cat $OUT/ncu_$v.short | head -30
done
date -u
