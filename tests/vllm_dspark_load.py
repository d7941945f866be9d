"""Run by the vLLM venv's Python (stdlib, torch, safetensors and vLLM only), for tests/test_engine_dspark.py:
vLLM's own Qwen3DSparkForCausalLM built from an exported drafter's config.json, its weights loaded by
vLLM's load_weights, and what it computes with the DSpark heads.

    python vllm_dspark_load.py TARGET DRAFTER RESULT.json

vLLM 0.32 drafts with DSpark only in its V2 model runner, which needs Triton (no CPU backend), so on
a CPU no engine serves it: the model is built here as its loader builds it, outside an engine.
RESULT: {"method", "architectures", "head_parameters", "equal": {tensor: bool}, "prev", "bias",
"confidence"} (bias: vLLM's Markov bias of the tokens `prev`, [n, V]; confidence: its sigmoid of the
confidence head on zeros hidden and those tokens' embeddings).
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file


def main(target: str, drafter: str, out: str) -> None:
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    model_config = ModelConfig(model=target, dtype="bfloat16", max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    config = VllmConfig(model_config=model_config, parallel_config=parallel)
    config.speculative_config = SpeculativeConfig(
        method="dspark",
        model=drafter,
        num_speculative_tokens=7,
        target_model_config=model_config,
        target_parallel_config=parallel,
    )
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:" + os.environ["PORT"], 0, "gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

        model = Qwen3DSparkForCausalLM(vllm_config=config)
        tensors = load_file(os.path.join(drafter, "model.safetensors"))
        model.load_weights(tensors.items())
        params = dict(model.named_parameters())
        heads = [n for n in params if "markov_head" in n or "confidence_head" in n]
        equal = {n: torch.equal(params["model." + n].float(), tensors[n].float()) for n in tensors if "head." in n}
        # then as vLLM's loader goes on (on CPU it may repack a linear's weight for its GEMM)
        process_weights_after_loading(model, model_config, torch.device("cpu"))
        prev = torch.tensor([0, 3, 17, 4094])
        with torch.no_grad():
            embed = model.markov_embed(prev)
            bias = model.markov_bias(embed)
            confidence = model.compute_confidence(torch.zeros(len(prev), model.config.hidden_size), embed)
    result = {
        "method": config.speculative_config.method,
        "architectures": config.speculative_config.draft_model_config.architectures,
        "head_parameters": sorted(heads),
        "equal": equal,
        "prev": prev.tolist(),
        "bias": bias.float().tolist(),
        "confidence": confidence.float().tolist(),
    }
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
