source .device/activate
timeout 330 python3 -m pytest -q tests/test_gpu_grouped.py tests/test_gpu_pdl.py 2>&1 | tail -4
timeout 240 python3 bench/bench_moe.py --max-seconds 200 --out $OUT 2>&1 | tail -1
