"""The tables in docs/*.md that restate the code, generated from it between marker comments.

    python tools/doc_tables.py           # rewrite every such table in place
    python tools/doc_tables.py --check   # change nothing; exit 1 naming each table that differs

A flag table lists a command's options as `--help` does: the flag and its metavar, the default (the
field's default_text, else its value) and the field's help text, from the stage's config dataclass
(stages/settings.py `setting`); options a command adds itself (`--json`) come from click.

    <!-- flags: extract -->                every option of the stage, in --help order
    <!-- flags: train --store --out -->    these options, in this order; the tables of a stage
                                           together list each of its options exactly once
    <!-- flags: train optim -->            the options of one component of the stage's config
                                           (TrainConfig.optim: stages/settings.py `part`), in order
    ...
    <!-- /flags -->

    <!-- consumers -->                     pipeline.drafter.serving_engines.CONSUMERS, one row each
    ...
    <!-- /consumers -->

    <!-- options: REF A B -->              the recipe bench's kept runs (bench/results/recipe_runs): each
    ...                                    option's paired difference from REF, at 200 and 1,000 steps
    <!-- /options -->                      (names as kept: default@p2 grad-bf16@p2, runs on 2 processes)

    <!-- plan: --nodes 4 -->               `pipeline plan --nodes 4`: the command and what it prints,
    ...                                    as an indented block (docs/scale.md's 27B run)
    <!-- /plan -->

tests/test_docs.py fails when a table differs from what this would write.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- (flags|consumers|options|plan)(?::\s*(.*?))? -->\n(.*?)^<!-- /\1 -->$", re.M | re.S)
COMMAND = "python tools/doc_tables.py"


def _importable() -> None:
    """The repository's modules (stages, recipe_results) importable when this runs as a script."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def stages() -> dict:
    """{stage: (click command, its config dataclass)}: every command whose options come from a config."""
    _importable()
    import evaluate
    import train
    from pipeline.cli import cli
    from stages.evaluate.config import EvalConfig
    from stages.export.config import ExportConfig
    from stages.extract.config import ExtractConfig
    from stages.plan.config import PlanConfig
    from stages.train.config import TrainConfig

    return {
        "extract": (cli.commands["extract"], ExtractConfig),
        "train": (train.main, TrainConfig),
        "evaluate": (evaluate.main, EvalConfig),
        "export": (cli.commands["export"], ExportConfig),
        "plan": (cli.commands["plan"], PlanConfig),
    }


def cell(text: str) -> str:
    """Text as one markdown table cell: pipes escaped, `<` kept from reading as a tag."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "\\<")


def default_of(option, field: dataclasses.Field | None, ctx) -> str:
    """The default as the docs state it: the field's default_text when it has one, else the value."""
    if field is not None and field.metadata.get("default_text"):
        return field.metadata["default_text"]
    value = option.get_default(ctx, call=False) if field is None else field.default
    if value is dataclasses.MISSING or option.required:
        return "required, repeatable" if option.multiple else "required"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == ():
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return f"`{value}`" if isinstance(value, str) else str(value)


def flag_rows(stage: str) -> dict[str, str]:
    """{flag: its table row} for every option of a stage, in --help order."""
    import click

    from stages.settings import leaves

    known = stages()
    if stage not in known:
        raise ValueError(f"no stage {stage!r} (one of {', '.join(known)})")
    command, config_cls = known[stage]
    fields = leaves(config_cls)
    ctx = click.Context(command)
    rows = {}
    for option in command.params:
        if not isinstance(option, click.Option) or option.hidden:
            continue
        field = fields.get(option.name)
        usage = option.get_help_record(ctx)[0]
        meaning = field.metadata["help"] if field is not None else option.help or ""
        rows[option.opts[0]] = f"| `{cell(usage)}` | {cell(default_of(option, field, ctx))} | {cell(meaning)} |"
    return rows


def named_flags(stage: str, names: list[str]) -> list[str]:
    """A marker's names as flags: a flag as it is, a component of the stage's config as its options."""
    from stages.settings import flag_of, leaves, parts

    config_cls = stages()[stage][1]
    components = parts(config_cls)
    out = []
    for name in names:
        if name.startswith("--"):
            out.append(name)
        elif name in components:
            out += [flag_of(config_cls, setting) for setting in leaves(components[name])]
        else:
            raise ValueError(f"{stage} has no component {name!r} (one of {', '.join(components) or 'none'})")
    return out


def flag_table(stage: str, names: list[str]) -> str:
    rows = flag_rows(stage)
    flags = named_flags(stage, names)
    unknown = [f for f in flags if f not in rows]
    if unknown:
        raise ValueError(f"{stage} has no option {', '.join(unknown)}")
    return "\n".join(["| flag | default | meaning |", "| --- | --- | --- |"] + [rows[f] for f in flags or rows])


def consumer_table() -> str:
    from pipeline.drafter.serving_engines import CONSUMERS

    def yes(b: bool) -> str:
        return "yes" if b else "no"

    lines = [
        "| consumer | sliding_attention layers | our rule on every layer | applies input_embedding_scale |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {cell(c.name)} | {cell(c.sliding)} | {yes(c.same_rule)} | {yes(c.applies_embedding_scale)} |"
        for c in CONSUMERS
    ]
    return "\n".join(lines)


BUDGETS = (200, 1000)


def options_table(names: list[str]) -> str:
    """REF's mean figures, then each option's flags and its paired differences from REF (chain tau, EOS-ended,
    pooled, and tau at T=1 when REF's runs have it) at each budget of the recipe bench, as its `table`
    computes them (recipe_results.py)."""
    _importable()
    from recipe_results import RESULTS, recipe_flags, table

    ref, options = names[0], names[1:]
    runs = {steps: table(RESULTS, steps, ref, options)["recipes"] for steps in BUDGETS}
    for steps, rows in runs.items():
        stores = {name: row["stores"] for name, row in rows.items()}
        other = [name for name in stores if stores[name] != stores.get(ref, stores[name])]
        if other:
            raise ValueError(
                f"<!-- options --> at {steps} steps: {', '.join(other)} trained on "
                f"{', '.join(stores[other[0]])}, {ref} on {', '.join(stores[ref])}: no paired figure"
            )
    keys = (("tau", "chain tau"), ("tau_eos", "EOS-ended"), ("tau_pooled", "pooled"))
    if any(runs[steps].get(ref, {}).get("tau_t1", {}).get("mean") is not None for steps in BUDGETS):
        keys += (("tau_t1", "tau@1"),)  # replayed on a store with final states (recipe_bench REPLAY_TEMPERATURE)
    head = " | ".join(f"{label}, {steps:,} steps" for steps in BUDGETS for _, label in keys)
    lines = [f"| option | flags | {head} |", "| --- | --- |" + " --- |" * len(BUDGETS) * len(keys)]
    for name in (ref, *options):
        rows = [runs[steps].get(name) for steps in BUDGETS]
        try:
            fields = recipe_flags(name.split("@")[0])
        except KeyError as e:
            raise ValueError(f"<!-- options --> names {name}: the recipe bench has no recipe {e}") from None
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in fields.items())
        cells = [_option_cell(row, k, runs[steps].get(ref)) for steps, row in zip(BUDGETS, rows) for k, _ in keys]
        lines.append(f"| {cell(name)} | {cell(flags) if flags else 'the defaults'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _option_cell(row: dict | None, key: str, ref: dict | None) -> str:
    """A figure of one option at one budget: the reference's (ref's) mean, or the paired difference from
    it, with the seeds it pairs when fewer than the reference has."""
    from recipe_results import versus

    if row is None:
        return "not run"
    if row[key].get("mean", 0) is None:  # a figure these runs did not measure (tau@1 without final states)
        return "-"
    if row is ref:
        return f"{row[key]['mean']:.3f} ({len(row['seeds'])} seeds)"
    paired = row[key].get("paired")
    n = len(paired["seeds"]) if paired else 0
    fewer = f"; {n} seed{'s' * (n != 1)}" if 0 < n < len(ref["seeds"]) else ""  # paired: ref has runs
    return cell(versus(paired, False) + fewer)


def plan_block(args: list[str]) -> str:
    """`pipeline plan ARGS` and what it prints, indented as a code block; ValueError if it refuses."""
    _importable()
    from click.testing import CliRunner

    from pipeline.cli import cli

    result = CliRunner().invoke(cli, ["plan", *args])
    if result.exit_code != 0:
        said = result.exception or result.output.strip()
        raise ValueError(f"<!-- plan: {' '.join(args)} --> is refused: {said}")
    lines = [" ".join(["pipeline plan", *args]), *result.output.rstrip("\n").splitlines()]
    return "\n".join(f"    {line}".rstrip() for line in lines)


def tables(text: str) -> list[tuple[re.Match, str]]:
    """(marker match, the body it should hold) for each generated table of a doc's text."""
    out = []
    for m in MARKER.finditer(text):
        kind, args = m.group(1), (m.group(2) or "?").split()
        table = {
            "flags": lambda: flag_table(args[0], args[1:]),
            "consumers": consumer_table,
            "options": lambda: options_table(args),
            "plan": lambda: plan_block([] if m.group(2) is None else m.group(2).split()),
        }[kind]()
        out.append((m, f"\n{table}\n\n"))
    return out


def render(text: str) -> str:
    """text with every generated table rewritten."""
    for m, body in reversed(tables(text)):
        start, end = m.span(3)
        text = text[:start] + body + text[end:]
    return text


def docs(root: Path = REPO) -> list[Path]:
    return sorted((root / "docs").glob("*.md"))


def stale(root: Path = REPO) -> list[str]:
    """One line per table under root/docs that differs from what would be generated."""
    out = []
    for path in docs(root):
        try:
            found = tables(path.read_text())
        except ValueError as e:
            out.append(f"{path.relative_to(root)}: {e}")
            continue
        for m, body in found:
            if m.group(3) != body:
                name = m.group(0).splitlines()[0]
                out.append(f"{path.relative_to(root)}: the table under {name} is out of date; run `{COMMAND}`")
    return out


def coverage(root: Path = REPO) -> list[str]:
    """Problems with the flag tables as a whole: a stage's option in no table or in two, a stage with no table."""
    listed: dict[str, list[str]] = {stage: [] for stage in stages()}
    for path in docs(root):
        for m in MARKER.finditer(path.read_text()):
            if m.group(1) == "flags":
                stage, *flags = (m.group(2) or "?").split()
                if stage not in listed:
                    return [
                        f"{path.relative_to(root)}: {m.group(0).splitlines()[0]} names no stage of {', '.join(listed)}"
                    ]
                try:
                    listed[stage] += named_flags(stage, flags) if flags else list(flag_rows(stage))
                except ValueError as e:
                    return [f"{path.relative_to(root)}: {e}"]
    problems = []
    for stage, flags in listed.items():
        every = list(flag_rows(stage))
        missing = [f for f in every if f not in flags]
        twice = sorted({f for f in flags if flags.count(f) > 1})
        unknown = [f for f in flags if f not in every]
        if not flags:
            problems.append(f"{stage}: no table (add <!-- flags: {stage} --> ... <!-- /flags --> to a doc)")
        if missing:
            problems.append(
                f"{stage}: {', '.join(missing)} in no table (add them to a <!-- flags: {stage} ... --> "
                f"marker, then run `{COMMAND}`)"
            )
        if twice:
            problems.append(f"{stage}: {', '.join(twice)} listed by more than one table")
        if unknown:
            problems.append(f"{stage}: no option {', '.join(unknown)} (remove it from its marker)")
    return problems


def main(argv: list[str]) -> int:
    problems = coverage()
    if "--check" in argv:
        problems += stale()
    else:
        for path in docs():
            text = path.read_text()
            try:
                new = render(text)
            except ValueError as e:
                problems.append(f"{path.relative_to(REPO)}: {e}")
                continue
            if new != text:
                path.write_text(new)
                print(f"rewrote {path.relative_to(REPO)}")
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
