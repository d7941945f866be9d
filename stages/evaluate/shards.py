"""Which shards of the store evaluation replays, and why (said in the console and the report):
--shards, else a checkpoint's held-out shards where they number this store's prompts, else every
committed shard."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.drafter.config import TrainingRecord
from stages.evaluate.conditioning import Checked
from stages.evaluate.config import EvalConfig
from store.errors import StoreError
from store.format.ranges import format_ranges, parse_ranges
from store.format.schema import ShardCommit
from store.hidden_store import HiddenStore


@dataclass(frozen=True)
class Replayed:
    """The shards of the store that evaluation replays, and why: said in the console and the report."""

    ids: list[int]
    chosen_by: str  # "--shards", "held-out" (a checkpoint's held-out shards) or "committed" (every committed shard)
    reason: str

    @property
    def text(self) -> str:
        return format_ranges(self.ids)


def choose_shards(
    config: EvalConfig,
    store: HiddenStore,
    loaded: list[Checked],
    warnings: list[str],
    committed: dict[int, ShardCommit] | None,
) -> Replayed:
    """--shards, else the held-out shards a checkpoint recorded of this store (or of a store holding the
    same prompts under the same shard numbers), else every committed shard of this store (committed:
    their records, as the store's index holds them; None: not known, read here). Another store's
    held-out shard numbers name that store's prompts, not this one's: they are never applied."""
    n = store.num_shards
    alike = [x for x in loaded if numbered_alike(x.record, store)]
    held = [x for x in alike if x.record.eval_shards]
    if config.shards:
        chosen = Replayed(parse_ranges(config.shards, n), "--shards", "given by --shards")
    elif held:
        recorded = [x.record.eval_shards for x in held]
        if len(set(recorded)) > 1:
            warnings.append(
                f"checkpoints recorded different held-out shards {sorted(set(recorded))}; using {recorded[0]}"
            )
        chosen = Replayed(
            parse_ranges(recorded[0], n),
            "held-out",
            f"the held-out shards (--eval-shards at training) of {held[0].path}, "
            + _trained_here(held[0].record, store),
        )
    else:
        chosen = Replayed(
            sorted(committed if committed is not None else store.committed()),
            "committed",
            "every committed shard of this store; " + _why_every(loaded, alike, store, warnings),
        )
    store.require_committed([s for s in chosen.ids if s not in (committed or {})])  # unless the index has them
    if not chosen.ids:
        raise StoreError(f"{store.location}: no committed shards to evaluate")
    for x in alike:
        overlap = sorted(set(chosen.ids) & set(parse_ranges(x.record.train_shards))) if x.record.train_shards else []
        if overlap:
            warnings.append(f"{x.path} was trained on shards {format_ranges(overlap)}, which are evaluated here")
    return chosen


def numbered_alike(record: TrainingRecord | None, store: HiddenStore) -> bool:
    """Whether a checkpoint's shard numbers name this store's prompts: it was trained on this store,
    or on one that holds the same dataset rows in each shard (the placement it recorded)."""
    attrs = store.attrs
    return record is not None and (
        record.store_fingerprint == attrs.fingerprint or record.store_placement == attrs.compat.placement()
    )


def _trained_here(record: TrainingRecord, store: HiddenStore) -> str:
    if record.store_fingerprint == store.attrs.fingerprint:
        return "trained on this store"
    return (
        f"trained on another store (fingerprint {record.store_fingerprint[:12]}) that holds the same prompts "
        "under the same shard numbers"
    )


def _why_every(loaded: list[Checked], alike: list[Checked], store: HiddenStore, warnings: list[str]) -> str:
    """Why no checkpoint's held-out shards apply here (alike: those numbered as this store is); warns
    where an older checkpoint cannot tell."""
    other = [x for x in loaded if x.record and x not in alike]
    for x in other:  # shard numbers beyond this store's cannot be its own: nothing to warn about
        numbers = [s for text in (x.record.train_shards, x.record.eval_shards) if text for s in parse_ranges(text)]
        if x.record.store_placement is None and x.record.eval_shards and max(numbers) < store.num_shards:
            warnings.append(
                f"{x.path} records no placement of its training store's prompts (trained before it was "
                f"recorded): if {store.location} holds those prompts under the same shard numbers, shards "
                f"{x.record.train_shards} were trained on; pass --shards {x.record.eval_shards} to replay "
                "only its held-out ones"
            )
    if other:
        x = other[0]
        held = (
            f", whose held-out shards {x.record.eval_shards} name that store's prompts" if x.record.eval_shards else ""
        )
        return f"{x.path} was trained on another store (fingerprint {x.record.store_fingerprint[:12]}){held}"
    if alike:
        return f"{alike[0].path} held out no shard of this store"
    return "the checkpoint records no held-out shards (a released checkpoint)"
