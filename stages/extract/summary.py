"""The summary of an extraction run: what was written and skipped, throughput, the store's state."""

from __future__ import annotations

from dataclasses import asdict

from pipeline.device import Process
from stages.extract.config import ExtractConfig
from store.format.ranges import format_ranges
from store.hidden_store import HiddenStore
from store.summary import agreement, final_state, fmt_agreement, fmt_counts, fmt_final_state, human_bytes, summarize


def finish_summary(store: HiddenStore, summary: dict) -> dict:
    """The run's own counts plus the store's totals, bytes and compression."""
    s = summarize(store)
    summary.update(
        {
            k: s[k]
            for k in (
                "bytes_on_disk",
                "hidden_bytes_on_disk",
                "hidden_bytes_raw_bf16",
                "compression_ratio",
                "shards_done",
                "num_shards",
                "missing",
                "sampled",
            )
        }
    )
    records = summary.pop("records")
    summary["agreement"] = agreement(records)
    summary["final_state"] = final_state(records) if any(r.final_state for r in records) else None
    summary["backends"] = asdict(summary["backends"])
    summary["tokens_per_s"] = summary["tokens"] / summary["wall_s"] if summary["wall_s"] else 0.0
    return summary


def render(s: dict) -> str:
    """The summary's lines; under a launcher each starts with the process's rank."""
    label = Process(**s["process"]).label()
    return "\n".join(label + line for line in _lines(s))


def _lines(s: dict) -> list[str]:
    t = s["timing"]
    ratio = f"{s['compression_ratio']}x" if s["compression_ratio"] else "n/a"
    return (
        [
            f"wrote {len(s['shards_written'])} shard(s) ({format_ranges(s['shards_written']) or 'none'}), "
            f"skipped {len(s['shards_skipped'])} already committed ({format_ranges(s['shards_skipped']) or 'none'})"
            + (
                f", left {len(s['shards_left'])} to other live processes ({format_ranges(list(s['shards_left']))}: "
                f"{', '.join(sorted(set(s['shards_left'].values())))})"
                if s["shards_left"]
                else ""
            ),
            f"samples {s['samples']}, tokens {s['tokens']} ({s['tokens_per_s']:.0f} tokens/s over {s['wall_s']:.1f}s); "
            f"skipped rows: {fmt_counts(s['skipped'])}; completions cut at the limit: {s['truncated']}",
            f"agreement: {fmt_agreement(s['agreement'], s['sampled'])}",
            *([f"final state: {fmt_final_state(s['final_state'])}"] if s.get("final_state") else []),
            f"store {s['store']}: {s['shards_done']}/{s['num_shards']} shards committed, "
            f"{human_bytes(s['bytes_on_disk'])} on disk; hidden states {human_bytes(s['hidden_bytes_on_disk'])} "
            f"vs {human_bytes(s['hidden_bytes_raw_bf16'])} raw bf16 ({ratio})",
            f"backend: linear attention {s['backends']['linear_attention']}, attention {s['backends']['attention']}; "
            f"time in generate {t['generate_s']:.1f}s, capture {t['capture_s']:.1f}s, prepare {t['prepare_s']:.1f}s, "
            f"waiting on the writer {t['stall_s']:.2f}s",
        ]
        + ([server_line(s["server"])] if "server" in s else [])
        + ([engine_line(s["capture_engine"], t["capture_s"])] if "capture_engine" in s else [])
        + modes_line(s["template_modes"])
        + ([s["index"]] if "index" in s else [])
    )


def modes_line(modes: dict) -> list[str]:
    """Rows per set of chat-template arguments, when any were given (none: no line)."""
    if set(modes) <= {"{}"}:
        return []
    return ["rows per chat-template mode: " + "; ".join(f"{k}: {n}" for k, n in sorted(modes.items()))]


def engine_line(v: dict, capture_s: float) -> str:
    """--capture vllm: the engine's start, its replies and the states' way out of it."""
    share = v["transport_s"] / capture_s if capture_s else 0.0
    generating = f"; {v['generate_s']:.1f}s generating the references" if v.get("generate_s") else ""
    return (
        f"capture engine: started in {v['start_s']:.1f}s; of the capture's {capture_s:.1f}s, "
        f"{v['engine_s']:.1f}s waiting on the engine, {v['transport_s']:.2f}s reading its files ({share:.0%})"
        + generating
    )


def server_line(v: dict) -> str:
    """The reference server's use, and the --concurrency to give it when the target waited on it."""
    line = (
        f"server: {v['requests']} requests, {v['mean_request_s']:.2f}s each, up to {v['concurrency']} in flight; "
        f"the target waited {v['waited_s']:.1f}s of {v['loop_s']:.1f}s for references"
    )
    if v["waited_s"] > 0.05 * v["loop_s"] and v["needed_in_flight"] > v["concurrency"]:
        line += (
            f"; keeping it busy needs about {v['needed_in_flight']} in flight: --concurrency "
            f"{v['needed_in_flight']} (if the server is already at its limit, add servers instead)"
        )
    return line


# Why a sample was skipped, and what to do about it, for the error of a run that stored none.
SKIPS = {
    "empty_prompt": ("with an empty prompt", "check that --messages-field or --prompt-field names the prompts"),
    "prompt_too_long": (
        "with a prompt of --max-length {max_length} tokens or more",
        "raise --max-length (it bounds prompt + completion)",
    ),
    "missing_response": (
        "without a response",
        "check that each row ends in an assistant turn or has --response-field, or use --responses regenerate",
    ),
    "server_rejected": ("rejected by the server", "see the server's log for why"),
    "nonfinite": ("with NaN or Inf states", "check the target and --dtype"),
}


def nothing_stored(
    config: ExtractConfig, shards: list[int], rows: int, dataset_rows: int, skipped: dict[str, int]
) -> str:
    """The error of a run whose shards hold no sample: `rows` dataset rows in `shards`, `skipped`
    the skip counts of their commit records; why, what to change, and how to write them again."""
    where = f"{config.store}: 0 samples stored in shard(s) {format_ranges(shards)} (dataset {config.dataset})"
    if not rows:
        return f"{where}: they hold none of its {dataset_rows} rows; choose --shards that hold rows"
    counts = sorted(
        ((n, SKIPS.get(reason, (f"skipped as {reason}", None))) for reason, n in skipped.items() if n),
        key=lambda c: -c[0],
    )  # the largest first
    why = ", ".join(f"{n} {what.format(max_length=config.max_length)}" for n, (what, _) in counts)
    fixes = "; ".join(dict.fromkeys(fix for _, (_, fix) in counts if fix)) or "check the dataset"
    return (
        f"{where}: of their {rows} rows, {why}. Fix: {fixes}. These shards are committed empty and a rerun "
        f"skips them: extract into a new --store (or delete {config.store}) once fixed"
    )
