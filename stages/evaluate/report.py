"""The evaluation report: OUT/report.json (schema in docs/evaluation.md), OUT/report.md, PNG plots,
and the console table. Every number says which tau convention it uses."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from stages.out_contents import REPORT, REPORT_FILES, REPORT_LOCK, Output
from stages.out_dir import claim, removed_if_failed_empty
from stages.paths import output_dir
from store.format.schema import StoreAttrs

CONVENTIONS = {
    "tau": "mean over prompts of each prompt's mean tokens per round; tokens per round = accepted drafts + 1 "
    "(the bonus token counted), cut to what is left at the end (the DFlash convention)",
    "tau_ci95": "95% interval of tau over prompts: tau +- 1.96 standard errors of the per-prompt means, the prompts "
    "taken as a sample of those the drafter will meet (so it has a width when every available prompt "
    "was replayed); the same rule for the whole sample, each group, chain and every DDTree budget",
    "sample": "prompts replayed: a uniform random sample without replacement (seeded) of the available prompts "
    "with a completion in the shards, unless all were asked for",
    "tau_pooled": "all committed tokens / all rounds, over every prompt",
    "served": "--served: the engine's own run over the same prompts; served tau = (completion tokens - 1) / verify "
    "steps, the last step cut to what is left as replay cuts it (vLLM itself counts accepted + 1 for every "
    "step: vllm_convention_tau); compared over the prompts whose served completion equals the stored one "
    "(agreeing) and over all",
    "histogram": "rounds by accepted drafts, 0..B-1",
    "per_slot": "share of rounds whose k-th draft was accepted (accepted >= k), k = 1..B-1",
    "ddtree": "DDTree-N: tree drafting with a node budget of N nodes (not N tokens); tau as above, "
    "tokens per round = accepted nodes + 1 <= min(N, B-1) + 1",
    "per_category": "tau per label of extraction's --category-field: the mean over that label's replayed prompts, "
    "with its interval over those prompts",
    "per_context": "tau per context-length bucket of the rounds (the tokens up to the block's start: <1k, 1k-4k, "
    "4k-16k, >=16k): per prompt its tokens per round over its rounds in the bucket, then the mean over "
    "the prompts with a chain round there, with its interval over those prompts",
    "replay": "greedy speculative decoding replayed from the stored states and the stored greedy completion; "
    "rounds start at the first completion token (produced by the prefill)",
}
SAMPLED = (
    "--temperature T: tau@T, the mean over prompts of each prompt's expected tokens per chain round under "
    "speculative sampling at T (drafts sampled from softmax(drafter logits / T), each accepted with probability "
    "min(1, p/q), p = softmax(lm_head(stored final state) / T); slot i accepted with probability "
    "sum_x min(p, q) given the slots before it accepted, chained; bonus counted and cut as tau's), over the "
    "blocks greedy replay drafts; the target's p at a block's later slots is the one along the stored "
    "reference, not along the sampled drafts (exact where they equal the reference's tokens); tau_low: the same "
    "mean of a lower bound that holds whatever the target does off the reference (slots 1..k-1 accepted as the "
    "reference's tokens, probability min(p(r), q(r)) each, then slot k accepted); tau_greedy_drafts: the same "
    "tau with the drafter's greedy drafts verified at T as vLLM's default draft_sample_method 'greedy' does "
    "(each accepted with probability p(draft), the draft probability taken as 1)"
)


def build(config, attrs: StoreAttrs, replayed, warnings: list[str], results: list[dict], sample: dict) -> dict:
    shards = replayed.text  # replayed: shards.Replayed, the shards and why
    return {
        "kind": "dflash-eval-report",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "store": config.store,
        "store_fingerprint": attrs.fingerprint,
        "target": attrs.target.path,
        "taps": list(attrs.taps),
        "shards": shards,
        "max_rounds": config.max_rounds,
        "ddtree_budgets": list(config.ddtree),
        "shards_chosen_by": replayed.chosen_by,
        "shards_reason": replayed.reason,
        "sample": sample,
        "warnings": warnings,
        "conventions": {**CONVENTIONS, **({"tau_at_temperature": SAMPLED} if config.temperature else {})},
        "checkpoints": results,
    }


def sampled_label(rep: dict) -> str | None:
    """'tau@T' of a report replayed with --temperature T, else None."""
    r = rep["checkpoints"][0] if rep["checkpoints"] else {}
    return f"tau@{r['tau_at_temperature']['temperature']:g}" if "tau_at_temperature" in r else None


def _sampled_cells(r: dict) -> list[str]:
    """tau@T and its interval of a checkpoint's results (or a group's), as table cells."""
    x = r["tau_at_temperature"]
    ci = f"{x['tau_ci95'][0]:.3f}-{x['tau_ci95'][1]:.3f}" if x["tau_ci95"] else "-"
    return [f"{x['tau']:.3f}", ci, f"{x['tau_low']:.3f}", f"{x['tau_greedy_drafts']:.3f}"]


def table(rep: dict) -> list[list[str]]:
    budgets, at = rep["ddtree_budgets"], sampled_label(rep)
    rows = [
        [
            "checkpoint",
            "tau",
            "tau 95% CI",
            *([at, f"{at} 95% CI", f"{at} lower bound", f"{at} greedy drafts"] if at else []),
            "tau pooled",
            *[f"DDTree-{b} tau" for b in budgets],
            "rounds",
            "prompts",
        ]
    ]
    for r in rep["checkpoints"]:
        ci = r["tau_ci95"]
        rows.append(
            [
                r["name"],
                f"{r['tau']:.3f}",
                f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "-",
                *(_sampled_cells(r) if at else []),
                f"{r['tau_pooled']:.3f}",
                *[f"{r['ddtree'][str(b)]:.3f}" for b in budgets],
                str(r["rounds"]),
                str(r["prompts"]),
            ]
        )
    return rows


GROUPS = (("per_category", "category"), ("per_context", "context"))  # result key, column name


def group_table(rep: dict, key: str, column: str) -> list[list[str]]:
    """Rows of tau per group (groups.py) of every checkpoint, chain and DDTree each with its interval;
    [] when no checkpoint has such groups."""
    budgets = rep["ddtree_budgets"]
    at = sampled_label(rep) if key == "per_category" else None  # a context bucket keeps no tau@T
    rows = [
        [
            r["name"],
            name,
            str(g["prompts"]),
            f"{g['tau']:.3f} {_ci(g['tau_ci95'])}",
            *([f"{g['tau_at_temperature']['tau']:.3f} {_ci(g['tau_at_temperature']['tau_ci95'])}"] if at else []),
            *[f"{g['ddtree'][str(b)]:.3f} {_ci(g['ddtree_ci95'][str(b)])}" for b in budgets],
        ]
        for r in rep["checkpoints"]
        for name, g in r.get(key, {}).items()
    ]
    header = ["checkpoint", column, "prompts", "tau (95% CI)", *([f"{at} (95% CI)"] if at else [])]
    return [[*header, *[f"DDTree-{b} tau (95% CI)" for b in budgets]], *rows] if rows else []


def _ci(ci) -> str:
    return f"({ci[0]:.3f}-{ci[1]:.3f})" if ci else "(-)"


def text_table(rows: list[list[str]]) -> list[str]:
    """Rows as aligned console lines, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    ]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def console(rep: dict) -> str:
    head = [f"WARNING: {w}" for w in rep["warnings"]]
    served = [f"{r['name']}: {served_text(r['served'])}" for r in rep["checkpoints"] if "served" in r]
    groups = [
        line
        for key, column in GROUPS
        if (rows := group_table(rep, key, column))
        for line in [f"tau by {column}:", *text_table(rows)]
    ]
    return "\n".join(
        head
        + [
            f"replay of {rep['store']} shards {rep['shards']}, {sample_text(rep['sample'])}; tau = "
            "mean over prompts of tokens per round (bonus counted); DDTree-N = node budget N",
            *text_table(table(rep)),
            *groups,
            *served,
        ]
    )


def served_text(sv: dict) -> str:
    a, b = sv["agreeing"], sv["all"]
    return (
        f"served by {sv['engine']}: {sv['identical_completions']} of {sv['prompts']} completions equal the "
        f"stored ones; on those served tau {a['served_tau']:.3f} vs replay {a['replay_tau']:.3f} "
        f"({a['difference']:+.2%}); over all {b['served_tau']:.3f} vs {b['replay_tau']:.3f} ({b['difference']:+.2%})"
    )


def served_md(sv: dict) -> list[str]:
    rows = [
        [label, x["prompts"], f"{x['served_tau']:.3f}", f"{x['replay_tau']:.3f}", f"{x['difference']:+.2%}"]
        for label, x in (("served completion = stored", sv["agreeing"]), ("all prompts", sv["all"]))
    ]
    out = [
        f"Served by {sv['engine']} on {sv['device']} ({sv['seconds']} s): "
        f"{sv['identical_completions']} of {sv['prompts']} completions equal the stored ones, "
        f"{sv['identical_rounds']} of those with the same rounds as replay; "
        f"vLLM's own convention (accepted + 1 every step) gives {sv['vllm_convention_tau']:.3f}.",
        "",
    ]
    out += md_table(["prompts", "n", "served tau", "replay tau", "served / replay - 1"], rows) + [""]
    slots = range(1, len(sv["agreeing"]["served_per_slot"]) + 1)
    return (
        out
        + md_table(
            ["slot (agreeing prompts)", *slots],
            [
                ["served", *(f"{p:.3f}" for p in sv["agreeing"]["served_per_slot"])],
                ["replay", *(f"{p:.3f}" for p in sv["agreeing"]["replay_per_slot"])],
            ],
        )
        + [""]
    )


def sample_text(sample: dict) -> str:
    n, of = sample["prompts"], sample["available"]
    text = f"all {n} prompts" if n == of else f"{n} of {of} prompts (random sample, seed {sample['seed']})"
    on = ", ".join(dict.fromkeys(sample["devices"]))
    return (
        text
        + f", drafter in {sample['dtype']}"
        + (f", {sample['processes']} processes" if sample["processes"] > 1 else "")
        + (f" on {on}" if on else "")
    )


def md_table(header: list, rows: list[list]) -> list[str]:
    """A markdown table: the header row, the separator, one line per row."""
    return ["| " + " | ".join(map(str, r)) + " |" for r in [header, ["---"] * len(header), *rows]]


def markdown(rep: dict) -> str:
    out = ["# Drafter evaluation (replay)", ""]
    out += [f"> **WARNING:** {w}" for w in rep["warnings"]] + ([""] if rep["warnings"] else [])
    out += [
        f"Store `{rep['store']}` (fingerprint `{rep['store_fingerprint'][:16]}`), target `{rep['target']}`, "
        f"taps {rep['taps']}, shards {rep['shards']}; {sample_text(rep['sample'])}.",
        "",
        f"Shards replayed: {rep['shards_reason']}.",
        "",
    ]
    if rep["sample"]["live_prompts"] is not None:
        out += [
            f"Live decoding with the target ran on the first {rep['sample']['live_prompts']} prompts of the sample.",
            "",
        ]
    rows = table(rep)
    out += md_table(rows[0], rows[1:]) + [""]
    for key, column in GROUPS:
        if rows := group_table(rep, key, column):
            out += [f"tau by {column}:", ""] + md_table(rows[0], rows[1:]) + [""]
    out += ["## Conventions", ""]
    out += [f"- **{k}**: {v}" for k, v in rep["conventions"].items()] + [""]
    for r in rep["checkpoints"]:
        out += [
            f"## {r['name']}",
            "",
            f"- path: `{r['path']}`",
            f"- conditioning: {r['check']}",
            f"- trained on shards: {r['train_shards'] or 'not recorded'}; step {r['step']}",
            "",
        ]
        out += md_table(["accepted drafts", *range(len(r["histogram"]))], [["rounds", *r["histogram"]]]) + [""]
        out += md_table(
            ["slot", *range(1, len(r["per_slot"]) + 1)], [["accepted", *(f"{p:.3f}" for p in r["per_slot"])]]
        ) + [""]
        out += served_md(r["served"]) if "served" in r else []
        out += md_table(
            ["shard", "index", "row", "prompt tokens", "completion tokens", "rounds", "tau"],
            [
                [
                    p["shard"],
                    p["index"],
                    p["row_id"],
                    p["prompt_len"],
                    p["completion_len"],
                    p["rounds"],
                    f"{p['tau']:.3f}",
                ]
                for p in r["per_prompt"]
            ],
        ) + [""]
    return "\n".join(out)


def plots(rep: dict, out: Path) -> list[Path]:
    from stages.plots import plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    n = len(rep["checkpoints"])
    for i, r in enumerate(rep["checkpoints"]):
        total = max(1, sum(r["histogram"]))
        xs = [k + (i - (n - 1) / 2) * 0.8 / n for k in range(len(r["histogram"]))]
        ax.bar(xs, [h / total for h in r["histogram"]], width=0.8 / n, label=f"{r['name']} (tau {r['tau']:.2f})")
    ax.set(xlabel="accepted drafts in a round", ylabel="share of rounds", title="acceptance histogram (chain)")
    paths = [_save(plt, fig, ax, out / "histogram.png")]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in rep["checkpoints"]:
        ax.plot(range(1, len(r["per_slot"]) + 1), r["per_slot"], "o-", markersize=4, label=r["name"])
    ax.set(
        xlabel="draft slot k", ylabel="share of rounds with draft k accepted", title="per-slot acceptance", ylim=(0, 1)
    )
    ax.grid(alpha=0.3)
    return paths + [_save(plt, fig, ax, out / "per_slot.png")]


def _save(plt, fig, ax, path: Path) -> Path:
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


FILES = REPORT_FILES  # what write() puts in OUT
OUTPUT = Output(
    command="evaluate.py",
    flag="--out",
    files=FILES,
    earlier="a report",
    scratch=REPORT,
    writes="evaluate.py writes its report into an empty directory or one holding an earlier report",
)


@contextlib.contextmanager
def claimed(out: Path, owner: bool = True) -> Iterator[None]:
    """OUT for this evaluate.py from its start until its report is written: made, held
    (OUT/.evaluate.lock, so a second evaluate.py on it is refused), and holding nothing but an
    earlier report (check_out says whether it may be replaced). A run that fails leaves no
    directory it made. owner False (another process of a launch): nothing."""
    if not owner:
        yield
        return
    with removed_if_failed_empty(out):
        output_dir(out, "--out")
        lock = claim(out / REPORT_LOCK, "--out", out, "evaluate.py")
        try:
            OUTPUT.check(out, force=True, mine=(REPORT_LOCK,))
            yield
        finally:
            lock.release()


def check_out(out: Path, force: bool) -> None:
    """Before the replay, once the checkpoints are checked: an earlier report in OUT only with --force."""
    OUTPUT.check(out, force, mine=(REPORT_LOCK,))


def write(rep: dict, out: Path) -> None:
    """Each file written whole to a temporary name, then renamed: a reader never sees half a report."""
    for stale in out.glob(".report.*.tmp*"):  # left by a run killed while writing
        stale.unlink(missing_ok=True)
    _atomic(out / "report.json", json.dumps(rep, indent=1) + "\n")
    _atomic(out / "report.md", markdown(rep))
    plots(rep, out)


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk: no temporary file left behind
        tmp.unlink(missing_ok=True)
        raise
