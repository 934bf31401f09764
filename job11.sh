source .device/activate
timeout 400 python3 -m pytest -q tests/test_gpu_grouped.py tests/test_gpu_pdl.py 2>&1 | tail -4
