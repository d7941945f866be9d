"""fla's two gated delta rule functions, as the naive recurrence (the rule's definition), each call
counted in CALLS."""

from collections import Counter

import torch
import torch.nn.functional as F

CALLS: Counter = Counter()


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g=None,
    beta=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    CALLS["chunk_gated_delta_rule"] += 1
    return _recurrence(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def fused_recurrent_gated_delta_rule(
    q,
    k,
    v,
    g=None,
    beta=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    CALLS["fused_recurrent_gated_delta_rule"] += 1
    return _recurrence(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _recurrence(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; state [B, HV, K, V] fp32.
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_t k_t))^T, o_t = S_t^T q_t * scale."""
    if cu_seqlens is not None:
        raise NotImplementedError("the stand-in keeps no packed sequences apart")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    q, k = (x.float().repeat_interleave(HV // H, dim=2) for x in (q, k))
    if l2norm:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    q = q * (K**-0.5 if scale is None else scale)
    S = torch.zeros(B, HV, K, V) if initial_state is None else initial_state.float().clone()
    out = torch.empty(B, T, HV, V)
    for t in range(T):
        S = S * g[:, t].float().exp()[..., None, None]
        delta = (v[:, t].float() - torch.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t].float()[..., None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out.to(v.dtype), (S if output_final_state else None)
