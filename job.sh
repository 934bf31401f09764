#!/bin/bash
source .device/activate >/dev/null 2>&1
export DETGEMM_CUTE_AOT_DIR=$HOME/aot
cd tests
timeout 330 python3 -m pytest -q -x test_gpu_fp32_decode.py > $OUT/decode_tests.log 2>&1 &
P1=$!
cd ..
timeout 330 python3 bench/bench_fp32_decode.py --out $OUT --sweep --max-seconds 250 --m-list ${MS:-1,4,16,32} --kn ${KN:-4096x4096,8192x1280,14336x4096,4096x14336} > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -v "^\[bench\] [0-9]*x" $OUT/bench.log | tail -5
python3 - <<'PY'
import json,os
d=json.load(open(os.environ['OUT']+'/fp32-decode_nvidia-h100-80gb-hbm3.json'))
for r in d['rows']:
    us=r['us']; print(r['M'],r['K'],r['N'],r['launch_shape'],all(r['bits_equal_split_path'].values()), {k.replace('fused_',''):round(v,1) for k,v in us.items() if v}, r['errors'] or '')
PY
wait $P1; echo "decode tests rc=$?"; tail -15 $OUT/decode_tests.log
