"""A stand-in for the Python of vLLM's venv, for --served tests without vLLM: it answers the
evaluator's probe (`-c ...`: vLLM is there) and, run as `vllm_worker.py REQUEST RESULT`, waits
$FAKE_VLLM_SECONDS (as a 27B engine loading would), then returns one token per prompt. The result's
metrics echo where it was asked to run: CUDA_VISIBLE_DEVICES and gpu_memory_utilization."""

import json
import os
import sys
import time

if sys.argv[1] == "-c":
    sys.exit(0)
request_path, result_path = sys.argv[2:4]
with open(request_path) as fh:
    req = json.load(fh)
time.sleep(float(os.environ.get("FAKE_VLLM_SECONDS", "0")))
result = {
    "vllm": "fake",
    "requests": [{"token_ids": [0], "accepted": [], "drafted": []} for _ in req["prompts"]],
    "metrics": {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_memory_utilization": req["gpu_memory_utilization"],
    },
}
with open(result_path, "w") as fh:
    json.dump(result, fh)
