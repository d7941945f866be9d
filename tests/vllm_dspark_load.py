"""Run by the vLLM venv's Python (stdlib, torch, safetensors and vLLM only), for tests/test_engine_dspark.py:
vLLM's own Qwen3DSparkForCausalLM built from an exported drafter's config.json, its weights loaded by
vLLM's load_weights, and what it computes with the DSpark heads.

    python vllm_dspark_load.py TARGET DRAFTER RESULT.json

vLLM 0.32 drafts with DSpark only in its V2 model runner, which needs Triton (no CPU backend), so on
a CPU no engine serves it: the model is built here as its loader builds it, outside an engine.
RESULT: {"method", "architectures", "head_parameters", "equal": {tensor: bool}, "prev", "bias",
"confidence", "hidden", "anchors", "drafts", "draft_confidence", "draft_logits"} (bias: vLLM's Markov
bias of the tokens `prev`, [n, V]; confidence: its sigmoid of the confidence head on zeros hidden and
those tokens' embeddings; drafts, draft_confidence, draft_logits [n, B-1, V]: what vLLM's own DSpark
drafting loop, DSparkSpeculator's _sample_sequential, drafts greedily, and each slot's biased logits it
drafted from, from the normed backbone outputs `hidden` [n, B, H] of n blocks whose first tokens are
`anchors`, with the target's lm_head shared as vLLM's loader shares it).
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
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_default_torch_dtype(model_config.dtype):  # as vLLM's loader builds it: bf16 parameters
            model = Qwen3DSparkForCausalLM(vllm_config=config)
        tensors = load_file(os.path.join(drafter, "model.safetensors"))
        model.load_weights(tensors.items())
        # the export has no lm_head: vLLM's DSpark loader shares the target's (load_dspark_model)
        model.lm_head.weight.data.copy_(load_file(os.path.join(target, "model.safetensors"))["lm_head.weight"])
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
        drafted = vllm_drafts(model, config.speculative_config.num_speculative_tokens)
    result = {
        "method": config.speculative_config.method,
        "architectures": config.speculative_config.draft_model_config.architectures,
        "head_parameters": sorted(heads),
        "equal": equal,
        "prev": prev.tolist(),
        "bias": bias.float().tolist(),
        "confidence": confidence.float().tolist(),
        **drafted,
    }
    with open(out, "w") as fh:
        json.dump(result, fh)


def vllm_drafts(model, steps: int, blocks: int = 4) -> dict:
    """vLLM's DSparkSpeculator._sample_sequential run as the V2 runner runs it, on a stand-in for the
    runner's buffers laid out as its prepare-inputs kernel lays out a DFlash block (sample_from_anchor
    false): block r's queries sit at r*(1+steps) .. r*(1+steps)+steps, the anchor first, and slot i is
    sampled from query r*(1+steps)+1+i, at its own position. Greedy: no draft logits kept."""
    from types import MethodType, SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    per = 1 + steps
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(blocks * per, model.config.hidden_size, generator=g).to(torch.bfloat16)
    anchors = torch.randint(0, model.config.vocab_size, (blocks,), generator=g)
    at = torch.arange(blocks) * per  # each block's anchor query
    input_ids = torch.zeros(blocks * per, dtype=torch.int64)
    input_ids[at] = anchors
    slots = torch.arange(steps)
    runner = SimpleNamespace(
        _draft_topk=None,
        num_speculative_steps=steps,
        model=model,
        sample_indices=(at[:, None] + 1 + slots).flatten(),
        sample_idx_mapping=torch.arange(blocks).repeat_interleave(steps),
        sample_pos=slots.repeat(blocks),
        input_buffers=SimpleNamespace(input_ids=input_ids),
        _anchor_idx=at,
        _step_cols=slots.to(torch.int32),
        use_confidence_head=True,
        draft_logits=None,
        draft_watermarker=None,
        acceptance_estimator=None,
        draft_tokens=torch.zeros(blocks, steps, dtype=torch.int64),
        draft_token_confidence_probs=torch.zeros(blocks, steps),
    )
    sample, seen = MethodType(DSparkSpeculator._sample_logits, runner), []

    def recording(logits, *rest):  # each slot's biased logits [n, V], as the loop hands them to its sampler
        seen.append(logits.float().clone())
        return sample(logits, *rest)

    runner._sample_logits = recording
    runner._maybe_predict_acceptance = MethodType(DSparkSpeculator._maybe_predict_acceptance, runner)
    with torch.no_grad():
        DSparkSpeculator._sample_sequential(runner, blocks, hidden)
    return {
        "hidden": hidden.view(blocks, per, -1).float().tolist(),
        "anchors": anchors.tolist(),
        "drafts": runner.draft_tokens.tolist(),
        "draft_confidence": runner.draft_token_confidence_probs.tolist(),
        "draft_logits": torch.stack(seen, dim=1).tolist(),
    }


if __name__ == "__main__":
    main(*sys.argv[1:4])
