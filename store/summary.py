"""What a store holds: shards done and missing, samples, tokens, bytes, ratio, provenance."""

from __future__ import annotations

import json

from store.format.ranges import format_ranges
from store.format.schema import to_json
from store.hidden_store import HiddenStore

TURNS = {"all": ", every assistant turn", "split": ", a sample per assistant turn"}  # compat.turns, as info shows it


def summarize(store: HiddenStore) -> dict:
    attrs = store.attrs
    committed = store.committed()
    checks = store.read_checks(committed)
    n_taps, hidden = len(attrs.taps), attrs.hidden_size
    tokens = sum(m.tokens for m in committed.values())
    skipped: dict[str, int] = {}
    for m in committed.values():
        for reason, n in m.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
    hidden_raw = tokens * n_taps * hidden * 2
    # each shard's bytes as its commit file records them (no walk over millions of files at scale);
    # older commit files lack them, and those shards are walked, once each
    sizes = [m.bytes or store.shard_bytes(s) for s, m in committed.items()]
    shard_bytes = sum(b["hidden"] for b in sizes)
    total = store.bytes_on_disk("target") + sum(b["shard"] for b in sizes)
    return {
        "store": store.location,
        "fingerprint": attrs.fingerprint,
        "num_shards": store.num_shards,
        "done": format_ranges(list(committed)),
        "missing": format_ranges([s for s in range(store.num_shards) if s not in committed]),
        "shards_done": len(committed),
        "samples": sum(m.samples for m in committed.values()),
        "tokens": tokens,
        "completion_tokens": sum(m.completion_tokens for m in committed.values()),
        "skipped": skipped,
        "truncated": sum(m.truncated for m in committed.values()),
        "agreement": agreement(committed.values()),
        "final_state": final_state(committed.values()) if attrs.compat.final_state else None,
        "sampled": attrs.compat.sampling is not None,
        "bytes_on_disk": total,
        "hidden_bytes_on_disk": shard_bytes,
        "hidden_bytes_raw_bf16": hidden_raw,
        "compression_ratio": round(hidden_raw / shard_bytes, 3) if shard_bytes else None,
        "bytes_per_token": round(total / tokens, 1) if tokens else None,
        "provenance": {
            "target": attrs.target.path,
            "model_class": attrs.target.model_class,
            "tokenizer_class": attrs.target.tokenizer_class,
            "non_text_tensors": attrs.target.non_text_tensors or {},
            "target_fingerprint": attrs.target.fingerprint,
            "taps": list(attrs.taps),
            "hidden_size": hidden,
            "vocab_size": attrs.vocab_size,
            "mask_token_id": attrs.mask_token_id,
            "linear_attention": attrs.backends.linear_attention
            + (" (Triton's interpreter on CPU, not a GPU)" if attrs.backends.triton == "interpreter" else ""),
            "attention": attrs.backends.attention,
            "capture": capture_text(attrs.compat.capture),
            "device": attrs.device,
            "dtype": attrs.dtype,
            "dataset": attrs.dataset.source,
            "responses": attrs.compat.responses
            + (f", sampled: {attrs.compat.sampling.describe()}" if attrs.compat.sampling else "")
            + TURNS.get(attrs.compat.turns, "")
            + (
                f"; chat template arguments {json.dumps(attrs.compat.chat_template_kwargs)}"
                if attrs.compat.chat_template_kwargs
                else ""
            )
            + (
                f"; each row's own from field {attrs.compat.dataset_fields['template_kwargs']!r}"
                if "template_kwargs" in attrs.compat.dataset_fields
                else ""
            ),
            "sampling": to_json(attrs.compat.sampling) if attrs.compat.sampling else None,
            "versions": attrs.versions,
            "layout": (
                f"{store.layout.describe()} level "
                f"{attrs.compat.compression_level}, chunks of {attrs.layout.chunk_tokens} tokens in files of "
                f"{attrs.layout.shard_tokens}"
            ),
            "checks": checks.describe(),
        },
    }


def render(s: dict) -> str:
    p = s["provenance"]
    ratio = f"{s['compression_ratio']}x" if s["compression_ratio"] else "n/a"
    lines = [
        f"store        {s['store']}",
        f"fingerprint  {s['fingerprint']}",
        f"shards       {s['shards_done']}/{s['num_shards']} done ({s['done'] or 'none'}); "
        f"missing: {s['missing'] or 'none'}",
        f"samples      {s['samples']}  (skipped: {fmt_counts(s['skipped'])}; "
        f"truncated at the length limit: {s['truncated']})",
        f"tokens       {s['tokens']}  ({s['completion_tokens']} completion)",
        f"agreement    {fmt_agreement(s['agreement'], s['sampled'])}",
        *([f"final state  {fmt_final_state(s['final_state'])}"] if s.get("final_state") else []),
        f"bytes        {human_bytes(s['bytes_on_disk'])} on disk; hidden {human_bytes(s['hidden_bytes_on_disk'])} "
        f"vs {human_bytes(s['hidden_bytes_raw_bf16'])} raw bf16, ratio {ratio}",
        f"layout       {p['layout']}",
        f"checks       {p['checks']}",
        f"target       {p['target']} ({p['model_class']}; tokenizer {p['tokenizer_class'] or 'not recorded'})",
        f"             unused non-text tensors: {fmt_counts(p['non_text_tensors'])}",
        f"             fingerprint {p['target_fingerprint'][:16]}...",
        f"taps         {p['taps']} (hidden {p['hidden_size']}, vocab {p['vocab_size']}, "
        f"mask token {p['mask_token_id']})",
        f"backend      linear attention: {p['linear_attention']}, attention: {p['attention']}, "
        f"device {p['device']}, dtype {p['dtype']}",
        f"capture      {p['capture']}",
        f"data         {p['dataset']} (responses: {p['responses']})",
        "versions     " + ", ".join(f"{k} {v}" for k, v in p["versions"].items()),
    ]
    return "\n".join(lines)


def capture_text(capture: dict | None) -> str:
    """What computed the states (compat.capture): an engine and its layout, or the extracting process."""
    if capture is None:
        return "the target loaded by the extracting process (transformers)"
    return (
        f"{capture['engine']} {capture['version']}, {capture['dtype']}, tensor parallel "
        f"{capture['tensor_parallel']}, pipeline parallel {capture['pipeline_parallel']}, "
        f"quantization {capture.get('quantization') or 'none'}, layer ids {capture['layer_ids']}"
    )


def agreement(records) -> dict | None:
    """Totals of the shards' agreement checks: matches, tokens, rate (None if no shard was checked)."""
    checked = [r.agreement for r in records if r.agreement]
    if not checked:
        return None
    matches, tokens = sum(a["matches"] for a in checked), sum(a["tokens"] for a in checked)
    return {
        "matches": matches,
        "tokens": tokens,
        "rate": round(matches / tokens, 6) if tokens else None,
        "shards_checked": len(checked),
    }


def final_state(records) -> dict:
    """Totals of the shards' final-state checks (ShardCommit.final_state, written by the extraction): the
    completion tokens whose next token is the argmax of lm_head(stored final state) and the stored states
    of unit RMS under the target's final-norm gain, with their rates."""
    checked = [r.final_state for r in records if r.final_state]
    total = {k: sum(c[k] for c in checked) for k in ("matches", "tokens", "normed", "states")}
    return {
        **total,
        "rate": round(total["matches"] / total["tokens"], 6) if total["tokens"] else None,
        "normed_rate": round(total["normed"] / total["states"], 6) if total["states"] else None,
        "shards_checked": len(checked),
    }


def fmt_final_state(f: dict) -> str:
    if not f["shards_checked"]:
        return "stored; no shard checked yet"
    rate = f"{100 * f['rate']:.2f}%" if f["rate"] is not None else "n/a"
    return (
        f"stored per token; argmax of lm_head(final state) is the next token for {rate} of {f['tokens']} "
        f"completion tokens; {f['normed']} of {f['states']} states of unit RMS under the final norm "
        f"({f['shards_checked']} shard(s) checked at extraction)"
    )


def fmt_agreement(a: dict | None, sampled: bool = False) -> str:
    """The agreement line. sampled: the references were sampled (compat.sampling), so the rate is
    reported as it is, not as a check: a sampled token is the argmax only as often as the
    temperature lets it be."""
    if not a or not a["tokens"]:
        return "not checked"
    return (
        f"{100 * a['rate']:.2f}% of {a['tokens']} completion tokens are the target's own argmax "
        f"({a['shards_checked']} shard(s) checked)"
        + ("; sampled references: below 100% by design, reported only" if sampled else "")
    )


def fmt_counts(counts: dict) -> str:
    """{'a': 2, 'b': 0} -> 'a 2' (zeros left out; 'none' when nothing is left)."""
    parts = [f"{k} {v}" for k, v in counts.items() if v]
    return ", ".join(parts) if parts else "none"


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)
