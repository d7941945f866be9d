"""Serve a drafter with vLLM over given prompts and write what vLLM measured. Run by the Python
that has vLLM (usually its own venv), never imported by dflash-pipeline: stdlib and vLLM only.

    python vllm_worker.py REQUEST.json RESULT.json

REQUEST: {"target", "drafter", "method" (dflash or dspark), "num_speculative_tokens", "max_model_len", "dtype", "seed",
          "gpu_memory_utilization" (null on CPU), "stop_token_ids": [..],
          "prompts": [{"prompt": [ids], "max_tokens": n}, ..]}
The GPU is the one CUDA_VISIBLE_DEVICES names (set by the caller).
RESULT:  {"vllm": version, "requests": [{"token_ids", "accepted", "drafted"}, ..] in request
          order (accepted/drafted: per verify step, vLLM's per-request "detailed" metrics),
          "metrics": {name: value or [values]} (the vllm:spec_decode_* counters)}
Exit 3 with {"error": ...} in RESULT when vLLM cannot be imported.
"""

import json
import sys


def engine(req: dict):
    import os

    if req.get("method") == "dspark":  # vLLM's DSpark speculator exists in its V2 model runner only
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    import torch
    from vllm import LLM

    share = req.get("gpu_memory_utilization")
    memory = {} if share is None else {"gpu_memory_utilization": share}
    return LLM(
        model=req["target"],
        dtype=req["dtype"],
        seed=req["seed"],
        max_model_len=req["max_model_len"],
        enable_prefix_caching=False,  # on CPU that path needs a Triton kernel; off everywhere for equal runs
        enforce_eager=not torch.cuda.is_available(),
        per_request_spec_decode_metrics="detailed",
        disable_log_stats=False,  # get_metrics() needs the stats
        speculative_config={
            "method": req.get("method", "dflash"),
            "model": req["drafter"],
            "num_speculative_tokens": req["num_speculative_tokens"],
        },
        **memory,
    )


def serve(req: dict) -> dict:
    from vllm import SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    llm = engine(req)
    prompts = [TokensPrompt(prompt_token_ids=p["prompt"]) for p in req["prompts"]]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=p["max_tokens"], stop_token_ids=req["stop_token_ids"], detokenize=False
        )
        for p in req["prompts"]
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    requests = []
    for out in outputs:
        seq = out.outputs[0]
        m = seq.spec_decode_metrics
        requests.append(
            {
                "token_ids": list(seq.token_ids),
                "accepted": list(m.per_step_accepted) if m else [],
                "drafted": list(m.per_step_drafted) if m else [],
            }
        )
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return {"vllm": __version__, "requests": requests, "metrics": metrics}


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as fh:
        req = json.load(fh)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        result, code = {"error": f"{sys.executable} cannot import vllm ({e})"}, 3
    else:
        result, code = serve(req), 0
    with open(result_path, "w") as fh:
        json.dump(result, fh)
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
