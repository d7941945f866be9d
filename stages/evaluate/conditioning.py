"""What evaluation checks before it replays: each checkpoint against the store's conditioning (our
checkpoints carry the store fingerprint; a released one is checked on what it carries: taps, hidden
size, vocabulary, mask token). Which shards it replays is stages/evaluate/shards.py. A checkpoint
trained on a store whose conditioning differs from this one's only in the hidden format (fp8 against
bf16) is replayed with a warning: serving hands a drafter bf16 states, so that is the tau an
fp8-trained drafter gets. So is one trained on a store made before the conv1d kernel was recorded
(compat.conv1d) whose conditioning is otherwise this one's, the kernel named in the warning."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline import device as devices
from pipeline.drafter import checkpoint
from pipeline.drafter.config import DrafterConfig, TrainingRecord, store_mismatches
from pipeline.drafter.model import Drafter
from pipeline.errors import DrafterError
from store.format import hidden_formats
from store.format.schema import Compat
from store.hidden_store import HiddenStore


@dataclass
class Checked:
    """A checkpoint whose config, tensor names and shapes were checked; its weights stay on disk
    until `tensors` reads them, so several checkpoints never sit in host memory together."""

    path: str
    config: DrafterConfig
    record: TrainingRecord | None  # None for a released checkpoint
    check: str  # how the conditioning was checked, for the report

    @property
    def tensors(self) -> dict:
        return checkpoint.load(self.path)[1]


def check_checkpoint(path: str, store: HiddenStore, allow_mismatch: bool, warnings: list[str]) -> Checked:
    config, record = checkpoint.inspect(path)
    attrs = store.attrs
    diff = store_mismatches(config, attrs)
    shape = [
        f"{label}: checkpoint has {diff[k][0]}, store has {diff[k][1]}"
        for k, label in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"), ("num_taps", "number of taps"))
        if k in diff
    ]
    if shape:
        raise DrafterError(f"{path} cannot run on {store.location}: " + "; ".join(shape))
    problems = [
        f"{label}: checkpoint {diff[k][0]}, store {diff[k][1]}"
        for k, label in (("taps", "taps"), ("mask_token_id", "mask token"))
        if k in diff
    ]
    fp = record.store_fingerprint if record else None
    other_store = fp is not None and fp != attrs.fingerprint
    unrecorded = other_store and record.store_conditioning == unrecorded_conv1d(attrs.compat)
    other_data = other_store and (record.store_conditioning == attrs.compat.conditioning() or unrecorded)
    if unrecorded:
        warnings.append(
            f"{path} was trained on a store that did not record its conv1d kernel; this store's states "
            f"were made with {attrs.compat.conv1d}: the conditioning is otherwise the same"
        )
    trained_on = other_format(record, attrs.compat) if other_store else None
    if other_store and not other_data and trained_on is None:
        problems.append(
            f"store fingerprint: trained on {fp[:12]}, this store is {attrs.fingerprint[:12]} "
            "(different target, taps, backend or capture engine, tokenizer or data)"
        )
    if problems and not allow_mismatch:
        raise DrafterError(
            f"{path} was not trained on this store's conditioning ({'; '.join(problems)}); "
            "pass --allow-mismatch to evaluate anyway"
        )
    if problems:
        warnings.append(f"MISMATCH allowed for {path}: " + "; ".join(problems))
        check = "mismatch (allowed): " + "; ".join(problems)
    elif fp is None:
        check = "released checkpoint: taps, hidden size, vocabulary and mask token match; store fingerprint not checked"
        warnings.append(
            f"{path} carries no store fingerprint (a released checkpoint): only taps, hidden size, "
            "vocabulary and mask token were checked"
        )
    elif trained_on is not None:
        check = (
            f"cross-format: trained on {trained_on} states (store {fp[:12]}), replayed on this store's "
            f"{attrs.compat.format.name} states; the conditioning is otherwise the same"
        )
        warnings.append(
            f"{path} was trained on {trained_on} states and is replayed on {attrs.compat.format.name} states "
            f"({store.location}): a cross-format evaluation, allowed because nothing else in the "
            "conditioning differs"
        )
    elif other_data:
        check = (
            f"conditioning matches (target, kernels, dtype, taps, tokenizer); trained on another store's data "
            f"(fingerprint {fp[:12]}, this store {attrs.fingerprint[:12]})"
        )
    else:
        check = "store fingerprint matches"
    return Checked(path, config, record, check)


def unrecorded_conv1d(compat: Compat) -> str | None:
    """The conditioning of these settings as a store made before the conv1d kernel was recorded
    has it (docs/store.md); None when this store records none either."""
    return None if compat.conv1d is None else dataclasses.replace(compat, conv1d=None).conditioning()


def other_format(record: TrainingRecord, compat: Compat) -> str | None:
    """The hidden format a checkpoint was trained on when it is not this store's and is the only
    difference in conditioning (an fp8-trained drafter replayed on bf16 states, as it is served); else None."""
    for fmt in hidden_formats.FORMATS.values():
        if fmt != compat.format and record.store_conditioning == compat.as_format(fmt.name).conditioning():
            return fmt.name
    return None


def build(loaded: Checked, embed, lm_head, device: str, dtype: str) -> Drafter:
    """The drafter on device, its weights in dtype. embed, lm_head: [V, H] bf16 as stored; in bf16
    they are used as they are (no copy), in fp32 copied. Only parameters change dtype: the RoPE
    frequencies stay fp32."""
    dt = devices.dtype(dtype)
    m = Drafter(loaded.config, embed.to(device, dt), lm_head.to(device, dt))
    for p in m.parameters():
        p.data = p.data.to(device, dt)
    checkpoint.load_into(m, loaded.tensors)
    return m.to(device).eval()
