"""vLLM 0.32's `extract_hidden_states` continues a multi-token step from the wrong token (vLLM issue
#56417, fix proposed in #56442, not released): its proposer's `prepare_next_token_ids_padded` reads
only the first column of the tokens a step sampled. When the step's draft is accepted the step emits
two tokens, the engine continues from the first one, and the completion repeats a token (measured here on the
shipped tiny target, 16 prompts, 96 greedy tokens: 2 completions differ from a plain engine's,
at their 5th token). Generation in the capture engine (the references of `--capture vllm`) is
exactly that path, so this module, imported by vllm_capture_connector.py in every engine process,
wraps the method: the step's LAST valid token is the one to continue from, and the count of valid
tokens is the count the step emitted. A step that emitted one token is passed through untouched.

Never imported by dflash-pipeline: stdlib, torch and vLLM only. Applied once per process; a vLLM
whose method is gone or already fixed is left as it is (`apply` says which).
"""

from __future__ import annotations

import torch

_MARK = "_dflash_last_valid_token"


def apply() -> str:
    """Wrap the proposer's method in this process: 'applied', 'already' or 'absent'."""
    try:
        from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    except ImportError:
        return "absent"
    original = getattr(ExtractHiddenStatesProposer, "prepare_next_token_ids_padded", None)
    if original is None:
        return "absent"
    if getattr(original, _MARK, False):
        return "already"

    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
        # sampled_token_ids: [B, K] int, a row's emitted tokens first, then -1 (rejected) or pads
        if sampled_token_ids.shape[1] == 1:
            return original(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask)
        valid = (sampled_token_ids >= 0) & (sampled_token_ids < gpu_input_batch.vocab_size)
        count = valid.sum(dim=1)  # [B]
        last = sampled_token_ids.gather(1, (count - 1).clamp(min=0).unsqueeze(1))  # [B, 1]
        last = torch.where(count.unsqueeze(1) > 0, last, torch.full_like(last, -1))
        next_ids, _ = original(self, last, requests, gpu_input_batch, discard_request_mask)
        return next_ids, count.to(torch.int32)

    setattr(prepare_next_token_ids_padded, _MARK, True)
    ExtractHiddenStatesProposer.prepare_next_token_ids_padded = prepare_next_token_ids_padded
    return "applied"
