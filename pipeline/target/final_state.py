"""The check of a stored final state (`pipeline extract --final-state`): the target's state after its
final norm, what its lm_head consumes. Two properties, each failing a wrong capture that the other
misses:

- **argmax**: on a store of greedy references, the argmax of lm_head(final state at t) is the token
  at t + 1 for nearly every completion token. A state one position off scores ~0 (the state after
  t predicts t + 2). Measured on the shipped tiny target, shards of the shipped prompts: 99.9%
  (fp32 target, bf16 store), 99.0% (bf16 target: bf16 near-ties between `generate`'s decoding and
  the one-pass capture), 98.4-98.9% (fp8 store), 99.7% for an engine's references (docs/performance.md);
  one position off either way: 0%. `MIN_RATE` is 0.9: far from both, and a shard of 50 completion
  tokens at 1.6% flips falls under it with probability ~1e-4.
- **unit RMS**: an RMSNorm's output divided by its gain g has RMS 1 per token (g = the norm applied
  to a vector of ones: (1 + w) for Qwen3.5's x * (1 + w), w for Llama's). A state taken before the
  norm does not: on the tiny target its RMS under g runs 0.56-1.95 per token, while the argmax of
  lm_head(pre-norm state) still agrees 99.4% (a positive scale per token does not move an argmax,
  and (1 + w) varies by 3% there). Sound states: 0.999-1.001 (bf16), 0.986-1.016 (fp8). A state is
  `normed` within `RMS_TOLERANCE` (5%); a shard needs `MIN_NORMED` (99%) of its states so.

The gain needs the target's weights, which the store does not hold, so `pipeline verify` recomputes
the argmax rate (from the stored final states and the stored lm_head) and extraction checks both.
On references that are not the target's greedy output (`--responses dataset`) the argmax rate is
reported, never enforced.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.errors import TargetError
from store.format.layout import FINAL_STATE
from store.shard_reader import ShardReader

MIN_RATE = 0.9  # the share of completion tokens argmax(lm_head(final state)) must hit on greedy references
RMS_TOLERANCE = 0.05  # |RMS(state / gain) - 1| at most this: the state is the norm's output
MIN_NORMED = 0.99  # the share of a shard's stored states that must be so
CHUNK = 1024  # positions whose logits are made at once ([CHUNK, V], never [tokens, V])


def greedy(compat) -> bool:
    """Whether a store's references (its `compat` record) are the target's greedy output, so that the argmax
    rate is enforced: regenerate and server without --temperature; dataset responses are anyone's, and
    sampled ones the argmax only as often as their temperature lets them be."""
    return compat.responses != "dataset" and compat.sampling is None


def argmax_matches(final: torch.Tensor, head: torch.Tensor, want: torch.Tensor) -> int:
    """final: [M, H] bf16, the states before each wanted token; head: [V, H] bf16, the lm_head (on the
    device to compute on); want: [M] long. How many argmax(final @ head.T) equal want, computed in fp32
    (the same on any device but for exact ties)."""
    matches = 0
    for lo in range(0, len(want), CHUNK):
        states = final[lo : lo + CHUNK].to(head.device, torch.float32)  # [c, H]
        logits = states @ head.T.float()  # [c, V]
        matches += int((logits.argmax(-1).cpu() == want[lo : lo + CHUNK]).sum())
    return matches


def completion_positions(lengths: list[int], prompt_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, next positions) of every completion token's prediction in rows laid back to back:
    the state at t predicts the token at t + 1, for t from each prompt's last token to the row's last but one."""
    at, start = [], 0
    for n, p in zip(lengths, prompt_lens):
        at.append(torch.arange(start + p - 1, start + n - 1))
        start += n
    pos = torch.cat(at) if at else torch.zeros(0, dtype=torch.long)
    return pos, pos + 1


def normed(final: torch.Tensor, gain: torch.Tensor) -> int:
    """final: [T, H] bf16; gain: [H] fp32. How many states have RMS(state / gain) within RMS_TOLERANCE of 1."""
    rms = (final.float() / gain.to(final.device)).pow(2).mean(-1).sqrt()  # [T]
    return int(((rms - 1).abs() <= RMS_TOLERANCE).sum())


def check_batch(
    final: torch.Tensor, tokens: torch.Tensor, lengths: list[int], prompt_lens: list[int], head, gain
) -> dict:
    """A batch's stored final states ([T, H] bf16, rows back to back; tokens: [T] long) checked:
    {"matches", "tokens"}: completion tokens hit by the argmax; {"normed", "states"}: states of unit RMS."""
    pos, nxt = completion_positions(lengths, prompt_lens)
    on = final.to(head.device)  # one copy to where lm_head is (the target's device)
    return {
        "matches": argmax_matches(on[pos.to(on.device)], head, tokens[nxt]),
        "tokens": len(pos),
        "normed": normed(on, gain),
        "states": len(final),
    }


def rate(record: dict) -> float | None:
    """The argmax rate of a check record (None: no completion token)."""
    return record["matches"] / record["tokens"] if record["tokens"] else None


def require(record: dict, where: str, compat) -> None:
    """A shard's check passed, or TargetError in one line naming it (`where`) and the figure that failed."""
    if record["states"] and record["normed"] < MIN_NORMED * record["states"]:
        raise TargetError(
            f"{where}: only {record['normed']} of {record['states']} final states "
            f"({record['normed'] / record['states']:.1%}) have unit RMS under the target's final-norm gain "
            f"(expected at least {MIN_NORMED:.0%} within {RMS_TOLERANCE:.0%}): the final state was not taken "
            "after the final norm; the shard is not committed"
        )
    r = rate(record)
    if greedy(compat) and r is not None and r < MIN_RATE:
        raise TargetError(
            f"{where}: argmax of lm_head(final state) is the next reference token for {r:.1%} of "
            f"{record['tokens']} completion tokens (expected at least {MIN_RATE:.0%} on greedy references): "
            "the final states are not aligned with the tokens; the shard is not committed"
        )


def recheck_shard(store, shard: int, head: torch.Tensor, sample: float | None = None) -> dict:
    """`pipeline verify`'s recomputation of a committed shard's argmax rate from what the store holds (its
    final states, tokens and lm_head: head [V, H] bf16): {"matches", "tokens"} over the completion tokens
    of every sample, or of a seeded share `sample` of them (at least one)."""
    reader = ShardReader(store, shard)
    picks = range(len(reader))
    if sample is not None and len(reader):
        picks = sorted(np.random.default_rng(shard).permutation(len(reader))[: max(1, round(sample * len(reader)))])
    matches = tokens = 0
    for i in picks:
        s = reader.read(int(i), final_state=True)
        pos, nxt = completion_positions([len(s.tokens)], [s.prompt_len])
        matches += argmax_matches(s.final_state[pos], head, s.tokens[nxt])
        tokens += len(pos)
    return {"matches": matches, "tokens": tokens}


def recheck(store, shards: list[int], sample: float | None = None) -> tuple[dict, dict[int, str]]:
    """Each of `shards` rechecked (`recheck_shard`): (their totals {"matches", "tokens", "rate"}, shard ->
    the problem of each under MIN_RATE on a store of greedy references)."""
    head = store.embedding("lm_head")
    totals, problems = {"matches": 0, "tokens": 0}, {}
    for shard in shards:
        got = recheck_shard(store, shard, head, sample)
        totals = {k: totals[k] + got[k] for k in totals}
        r = rate(got)
        if greedy(store.attrs.compat) and r is not None and r < MIN_RATE:
            problems[shard] = (
                f"{FINAL_STATE}: argmax of lm_head(stored final state) is the next token for {r:.1%} of "
                f"{got['tokens']} completion tokens (at least {MIN_RATE:.0%} expected on greedy references): "
                "the final states are not aligned with the tokens"
            )
    return {**totals, "rate": rate(totals)}, problems


def describe(totals: dict, compat) -> str:
    """`pipeline verify`'s line for the recomputed rate."""
    if not totals["tokens"]:
        return "final state: no completion token to check"
    enforced = f"at least {MIN_RATE:.0%} required" if greedy(compat) else "reported only: not greedy references"
    return (
        f"final state: argmax of lm_head(stored final state) is the next token for {rate(totals):.2%} of "
        f"{totals['tokens']} completion tokens ({enforced})"
    )
