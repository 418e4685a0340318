cd .wtp && timeout 200 python3 -m pytest tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider   # 30 passed, 63 deselected
