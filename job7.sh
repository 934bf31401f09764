#!/bin/bash
source .device/activate
export CUTE_DSL_CACHE_DIR=/tmp/dslcache
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv > $OUT/smi.log
timeout 400 python3 bench/probe_onewave.py clocks 600x9216x2304 296x8192x5120 512x14336x3584 200x14336x3584 2048x4096x6144 --out $OUT/clocks.md > $OUT/clocks.log 2>&1
cd $OUT && tar cJf all.tar.xz * && find . -mindepth 1 ! -name all.tar.xz -delete
