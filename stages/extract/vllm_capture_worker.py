"""Capture tap states inside vLLM, one engine for many batches. Run by the Python that has vLLM
(usually its own venv), never imported by dflash-pipeline: stdlib, torch, safetensors and vLLM only.

    python vllm_capture_worker.py CONFIG.json

CONFIG: {"target", "layer_ids": [vLLM aux layer ids: id L = the output of decoder layer L-1],
         "dtype", "max_model_len", "gpu_memory_utilization" (null: vLLM's default),
         "tensor_parallel_size", "pipeline_parallel_size", "quantization" (null: the checkpoint's own),
         "transport_dir", "seed"}
The engine prefills each sequence once (max_tokens=1: no multi-token generation is involved) with
speculative method `extract_hidden_states` and the connector of vllm_capture_connector.py, which
leaves each sequence's states in TRANSPORT_DIR/<request>.safetensors ("hidden_states" [T, n_taps, H]
in the engine's dtype, "token_ids" [T]).

Line protocol, one JSON object a line. The worker's stdout is moved to stderr at start (vLLM and its
processes log there), its replies go to the original stdout:
  reply   {"ready": true, "vllm": version, "num_layers", "hidden_size", "layout": {...}}  once the
          engine is up and has captured a few tokens (`warm_up`; layout: what the engine reports it
          runs with, `layout()`), or {"error": "..."} and exit 3 (vLLM cannot be imported, an
          architecture it cannot capture, found before the engine starts: `uncapturable`; a layer id
          out of range)
  request {"seqs": [[ids], ..], "prompt_lens": [n, ..] or null}   (token ids, not states)
  reply   {"files": [path, ..], "matches": [m, ..] or null}      files in request order, written and
          unlocked; matches: per sequence, how many tokens after its prompt are the engine's own
          greedy choice at the position before (from prompt logprobs: rank 1)
  request {"prompts": [[ids], ..], "max_tokens": [n, ..], "stop_token_ids": [ids]}
  reply   {"completions": [[ids], ..]}   each prompt's greedy completion by this engine, cut at its
          first stop token (kept) or its max_tokens; the states the connector wrote for these
          requests are deleted (the capture is a later prefill of prompt + completion). Generating
          here is vLLM's multi-token path under extract_hidden_states: vllm_next_token_fix.py.
End of input: the engine shuts down and the worker exits 0. The caller reads and deletes the files.
"""

import fcntl
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def engine(config: dict):
    import torch
    from vllm import LLM

    share = config.get("gpu_memory_utilization")
    memory = {} if share is None else {"gpu_memory_utilization": share}
    return LLM(
        model=config["target"],
        dtype=config["dtype"],
        seed=config["seed"],
        max_model_len=config["max_model_len"],
        tensor_parallel_size=config["tensor_parallel_size"],
        pipeline_parallel_size=config["pipeline_parallel_size"],
        quantization=config["quantization"],
        # Off: every position's state comes from this request's own prefill (a cached prefix is not
        # run again), and on CPU a hybrid target's prefix cache needs a Triton kernel.
        enable_prefix_caching=False,
        enforce_eager=not torch.cuda.is_available(),
        worker_extension_cls="vllm_capture_worker.KernelReport",
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": config["layer_ids"]}},
        },
        kv_transfer_config={
            "kv_connector": "HostCopyHiddenStatesConnector",
            "kv_connector_module_path": "vllm_capture_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": config["transport_dir"]},
        },
        **memory,
    )


def uncapturable(config: dict) -> str | None:
    """Why vLLM cannot capture this target's states, found from its config before any weight loads
    (None: it can). extract_hidden_states reads the model's aux hidden state outputs, which only a
    model class with vLLM's SupportsEagle3 interface (`set_aux_hidden_state_layers`) returns; vLLM
    itself refuses such a model only after loading its weights (the model runner's
    `_setup_eagle3_aux_hidden_state_outputs`), minutes into a large target's start."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.interfaces import supports_eagle3

    try:  # the architecture resolved as vLLM's LLM resolves it: natively, or its Transformers backend
        args = EngineArgs(model=config["target"], dtype=config["dtype"], max_model_len=config["max_model_len"])
        model_config = args.create_model_config()
        model_class, arch = model_config.registry.resolve_model_cls(model_config.architectures, model_config)
    except Exception as e:  # vLLM refuses the target (an architecture it does not serve, ...): its first sentence
        traceback.print_exc()  # the whole of it in the log
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        why = next((line.split("Value error, ", 1)[1] for line in lines if "Value error, " in line), lines[0])
        return f"vLLM refuses {config['target']}: {why.split(' [type=')[0].split('. ')[0]}"
    if not supports_eagle3(model_class):
        return (
            f"vLLM serves {arch} as {model_class.__name__}, which cannot hand out its layers' hidden states "
            "(no set_aux_hidden_state_layers, vLLM's SupportsEagle3 interface, which extract_hidden_states needs)"
        )
    return None


def layout(llm) -> dict:
    """What the engine runs with, as it reports it after start: its parallel sizes, the quantization
    it applies (None: none) and the checkpoint's own (its quantization_config's method, None: none),
    and the kernels its workers chose (attention backends by name, the linear layers' methods and
    kernels), asked of every worker once."""
    config = llm.llm_engine.vllm_config
    own = getattr(config.model_config.hf_config, "quantization_config", None)
    return {
        "tensor_parallel": config.parallel_config.tensor_parallel_size,
        "pipeline_parallel": config.parallel_config.pipeline_parallel_size,
        "quantization": config.model_config.quantization,
        "checkpoint_quantization": own.get("quant_method")
        if isinstance(own, dict)
        else getattr(own, "quant_method", None),
        "kernels": merged(llm.collective_rpc("dflash_kernels")),
    }


class KernelReport:
    """Mixed into each engine worker (vLLM's worker_extension_cls), so the worker can be asked by
    name: vLLM sends a method's name to its workers, a function only with pickling allowed."""

    def dflash_kernels(self) -> dict:
        """This worker's attention backends and its linear layers' kernels (or methods), by name."""
        groups = getattr(self.model_runner, "attn_groups", [])
        found = {"attention": {g.backend.get_name() for gs in groups for g in gs}, "linear": set()}
        for module in self.model_runner.model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(module, "weight"):
                kernel = getattr(method, "fp8_linear", None) or getattr(method, "kernel", None)
                found["linear"].add(type(kernel if kernel is not None else method).__name__)
        return {k: sorted(v) for k, v in found.items()}


def merged(replies: list[dict]) -> dict:
    """The workers' kernels as one record (every name any worker reported)."""
    return {k: sorted({n for r in replies for n in r.get(k, [])}) for k in ("attention", "linear")}


def capture(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    lens = request.get("prompt_lens")
    params = SamplingParams(
        temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=None if lens is None else 1
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in request["seqs"]], params, use_tqdm=False)
    files = [written(out) for out in outputs]
    matches = None if lens is None else [agreeing(o, n) for o, n in zip(outputs, lens)]
    return {"files": files, "matches": matches}


def complete(llm, request: dict) -> dict:
    """Greedy completions of the prompts (max_tokens > 0 each), their connector files deleted."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=request["stop_token_ids"], detokenize=False)
        for n in request["max_tokens"]
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        os.remove(written(out))
    return {"completions": [list(out.outputs[0].token_ids) for out in outputs]}


def written(out) -> str:
    """The file the connector wrote for this request, once written; its lock file removed."""
    path = out.kv_transfer_params["hidden_states_path"]
    with open(path + ".lock") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)  # the connector's writer holds it exclusively until written
    os.remove(path + ".lock")
    return path


def warm_up(llm) -> None:
    """One capture of a few tokens before the ready reply, its file removed: an engine that loads but
    cannot run this target's forward (a kernel it lacks, heads its ranks cannot split) stops here, its
    error in the log, before the caller claims any work."""
    for path in capture(llm, {"seqs": [list(range(1, 9))], "prompt_lens": None})["files"]:
        os.remove(path)


def agreeing(out, prompt_len: int) -> int:
    """Tokens after the prompt that were the engine's argmax at the position before (rank 1)."""
    ids, logprobs = out.prompt_token_ids, out.prompt_logprobs
    return sum(1 for t in range(max(prompt_len, 1), len(ids)) if logprobs[t][ids[t]].rank == 1)


def main(config_path: str) -> int:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # everything else written to stdout (vLLM's logs, its processes') goes to stderr
    sys.stdout = sys.stderr
    with open(config_path) as fh:
        config = json.load(fh)
    try:
        import vllm
    except ImportError as e:
        reply.write(json.dumps({"error": f"{sys.executable} cannot import vllm ({e})"}) + "\n")
        return 3
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, HERE)  # the connector's module, for this process and the engine's
    why = uncapturable(config)
    if why:
        reply.write(json.dumps({"error": why}) + "\n")
        return 3
    llm = engine(config)
    hf = llm.llm_engine.model_config.hf_text_config
    layers = hf.num_hidden_layers
    bad = [i for i in config["layer_ids"] if not 1 <= i <= layers]
    if bad:
        reply.write(json.dumps({"error": f"layer id(s) {bad} outside 1-{layers} ({config['target']})"}) + "\n")
        return 3
    warm_up(llm)
    ready = {"ready": True, "vllm": vllm.__version__, "num_layers": layers, "hidden_size": hf.hidden_size}
    reply.write(json.dumps({**ready, "layout": layout(llm)}) + "\n")
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            answer = complete(llm, request) if "prompts" in request else capture(llm, request)
            reply.write(json.dumps(answer) + "\n")
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the interpreter's teardown after vLLM's threads aborts (SIGABRT)
