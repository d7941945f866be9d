"""Validation during training, on the held-out shards (--eval-shards).

Two measures, each on a fixed seeded sample of the held-out samples, the same at every call:

- teacher-forced: loss, streak tau and per-slot accuracy over random anchors (fixed ones), on
  --eval-samples samples read by the loader workers;
- replayed: chain tau by the evaluator's own rule (pipeline/decode/batch_replay.py: greedy
  speculative decoding replayed on the stored states, tau the mean over prompts of tokens per
  round), on --eval-replay-prompts prompts, with the drafter's fp32 master weights. This is the
  figure evaluate.py reports (there in bf16 by default); streak tau is an optimistic guide to it.

Both read through the run's one store and node cache (`Setup.store`), as training does.
"""

from __future__ import annotations

import torch

from pipeline.decode.batch_replay import BatchReplay
from pipeline.drafter.loss import summarize, zero_sums
from stages.train.config import TrainConfig
from stages.train.epoch_order import epoch_batches
from stages.train.loader import loader
from stages.train.samples import sample_refs
from stages.train.step import forward_loss, step_generator
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader

REPLAY_SLOTS = 32  # prompts replayed together (one drafter forward per round for all of them)


@torch.no_grad()
def validate(setup, config: TrainConfig, replay: bool = True) -> dict:
    """The teacher-forced figures and, when asked and --eval-replay-prompts is not 0, the replayed ones."""
    acc = setup.accelerator
    setup.model.eval()
    refs = sample_refs(setup.eval_refs, config.run.eval_samples, config.data.seed)
    batches = epoch_batches(refs, config.data.batch_size, config.data.seed, 0)[acc.process_index :: acc.num_processes]
    total = zero_sums(setup.drafter_config.block_size, acc.device)
    for i, batch in enumerate(
        loader(
            config.data,
            batches,
            acc.device.type == "cuda",
            setup.skipped,
            store=setup.store,
            node_cache=setup.node_cache,
            final_state=setup.plan.soft != "none",
        )
    ):
        batch = batch.to(acc.device)
        gen = step_generator(config.data.seed, -1, i, acc.process_index, acc.device)
        with acc.autocast():
            total += forward_loss(setup.model, setup.raw, batch, setup.plan, gen).sums
    record = {**summarize(acc.reduce(total, reduction="sum")), "samples": len(refs)}
    return record | (replayed(setup, config) if replay and config.run.eval_replay_prompts != 0 else {})


def replayed(setup, config: TrainConfig) -> dict:
    """tau_replay (mean over prompts of tokens per round, chain drafting) and tau_replay_pooled (all
    tokens / all rounds) over a fixed sample of --eval-replay-prompts held-out prompts, each rank
    replaying every world-th of them."""
    acc = setup.accelerator
    refs = sample_refs(setup.eval_refs, config.run.eval_replay_prompts, config.data.seed)
    sums = replay_sums(setup.raw, setup.store, refs[acc.process_index :: acc.num_processes])
    tau_sum, prompts, tokens, rounds = acc.reduce(sums.to(acc.device), reduction="sum").tolist()
    return {
        "tau_replay": tau_sum / prompts if prompts else float("nan"),
        "tau_replay_pooled": tokens / rounds if rounds else float("nan"),
        "replay_prompts": int(prompts),
    }


def replay_sums(m, store: HiddenStore, refs: list) -> torch.Tensor:
    """Chain replay of the whole stored samples of refs -> [4] float64: the sum of the prompts' taus,
    the prompts with a round, their tokens and their rounds (summable over ranks)."""
    sums = torch.zeros(4, dtype=torch.float64)
    if not refs:
        return sums
    readers = {shard: ShardReader(store, shard) for shard in sorted({r.shard for r in refs})}
    capacity = max(int(readers[r.shard].offsets[r.index + 1] - readers[r.shard].offsets[r.index]) for r in refs)
    engine = BatchReplay(m, (), min(REPLAY_SLOTS, len(refs)), capacity)
    for c in engine.run(readers[r.shard][r.index] for r in refs):  # whole samples, read as they are replayed
        if c.rounds[0]:
            sums += torch.tensor([c.tau(0), 1, c.tokens[0], c.rounds[0]], dtype=torch.float64)
    return sums
