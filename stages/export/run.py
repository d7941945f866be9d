"""`pipeline export`: a drafter checkpoint (a run's step-N or final, or any DFlash drafter) as a
serving checkpoint: config.json (with auto_map), bf16 model.safetensors, modeling_dflash.py and a
model card, README.md; nothing else.

The drafter is loaded strictly and saved again through pipeline/drafter/checkpoint.py, into a
hidden sibling of OUT_DIR published by a rename, so OUT_DIR is never half written. The store
(the checkpoint's own by default) gives the target record for the card and the serving checks; a
replay report gives the card's tau table. Both must come from the checkpoint's store.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import torch

from pipeline.drafter import checkpoint, serving_engines
from pipeline.drafter.config import DrafterConfig, TrainingRecord, store_mismatches
from pipeline.errors import DrafterError
from stages.export.card import CardRecord, Measured, render
from stages.export.config import ExportConfig
from stages.out_contents import Output, refuse_a_store
from stages.out_dir import claim, removed_if_failed_empty
from stages.paths import output_dir
from store.errors import ConfigError, UserError
from store.format.schema import StoreAttrs
from store.hidden_store import HiddenStore
from store.summary import human_bytes

CARD = "README.md"
FILES = (*checkpoint.SERVING_FILES, CARD)  # exactly what OUT_DIR holds
OUTPUT = Output(
    command="pipeline export",
    flag="OUT_DIR",
    files=FILES,
    earlier="an earlier export",
    whole=True,
    writes="export writes a serving checkpoint into an empty directory or one holding an earlier export",
)
REPORT_KIND = "dflash-eval-report"


def run(source: str, out: str, config: ExportConfig, log=print) -> dict:
    """Write OUT as the serving checkpoint of SOURCE; returns what was written. OUT must be empty or
    an earlier export (replaced only with --force), and no other export may be writing it. A failed
    export leaves no directory it created (OUT's parents) behind."""
    src, dst = Path(source), Path(out)
    with removed_if_failed_empty(out):
        _check_destination(src, dst, config.force)
        where = Path(os.path.abspath(dst))  # '.' and '..' spelled out: the lock and the files go beside it
        lock = claim(where.with_name(f".{where.name}.export.lock"), "OUT_DIR", out, "pipeline export")
        try:
            return _run(src, dst, config, log)
        finally:
            lock.release()


def _run(src: Path, dst: Path, config: ExportConfig, log) -> dict:
    drafter, tensors, record = checkpoint.load(src)
    notes: list[str] = []
    attrs, skipped = _open_store(config, record, drafter, notes)
    measured = _measured(config, src, record, attrs, notes) if config.report else None
    caveats = serving_engines.serving_warnings(drafter, attrs.target if attrs else None)
    if attrs is not None and not attrs.target.layer_types:
        notes.append("vLLM KV-cache groups not checked: the store predates recording the target's layer types")
    if skipped:
        notes.append(f"target checks skipped ({skipped}): the vLLM KV-cache group check did not run")
    converted = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()} - {"bfloat16"})
    if converted:
        notes.append(f"weights converted from {', '.join(converted)} to bfloat16")
    for w in caveats + notes:
        log(f"warning: {w}")
    card = CardRecord(
        out=str(dst),
        drafter=drafter,
        training=record,
        target=attrs.target if attrs else None,
        target_layers=attrs.num_layers if attrs else drafter.num_target_layers,
        skipped=skipped,
        measured=measured,
        evaluate=_evaluate_command(config, record, src),
        caveats=tuple(caveats + notes),
    )
    _write(dst, drafter, tensors, record, render(card), config.force)
    return {
        "checkpoint": str(src),
        "out": str(dst),
        "files": {f: (dst / f).stat().st_size for f in FILES},
        "step": record.step if record else None,
        "target": attrs.target.path if attrs else None,
        "tau": measured.tau if measured else None,
        "warnings": caveats + notes,
    }


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    """OUT_DIR is neither the checkpoint nor inside it, empty or an earlier export (replaced only with
    force), not the current directory (a rename replaces it), and its parent can be written (the
    files are written beside it first)."""
    s, d = src.resolve(), dst.resolve()
    if d == s or d in s.parents:
        raise ConfigError("OUT_DIR", str(dst), f"holds the checkpoint {src} itself; export to another directory")
    if s in d.parents:
        raise ConfigError("OUT_DIR", str(dst), f"lies inside the checkpoint {src}; export to another directory")
    if dst.exists() and not dst.is_dir():
        raise ConfigError("OUT_DIR", str(dst), "exists and is not a directory")
    refuse_a_store(dst, "OUT_DIR")
    OUTPUT.check(dst, force)
    if d == Path.cwd().resolve():
        raise ConfigError(
            "OUT_DIR",
            str(dst),
            "is the current directory, which export cannot replace (it publishes "
            "OUT_DIR by a rename); run it from another directory",
        )
    output_dir(Path(os.path.abspath(dst)).parent, "OUT_DIR", shown=dst)  # the files are written there first


def _open_store(
    config: ExportConfig, record: TrainingRecord | None, drafter: DrafterConfig, notes: list[str]
) -> tuple[StoreAttrs | None, str | None]:
    """(the store's attributes, None), or (None, why the target checks were skipped)."""
    path = config.store or (record.store if record else None)
    if path is None:
        return None, "no --store given and the checkpoint records none"
    try:
        attrs = HiddenStore(path).attrs
    except (UserError, OSError, ValueError, KeyError) as e:
        return None, f"store {path} cannot be opened: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    problems = [f"{k}: checkpoint {a}, store {b}" for k, (a, b) in store_mismatches(drafter, attrs).items()]
    if record is not None and record.store_fingerprint != attrs.fingerprint:
        problems.append(
            f"store fingerprint: trained on {record.store_fingerprint[:12]}, {path} is {attrs.fingerprint[:12]}"
        )
    if problems and not config.allow_mismatch:
        raise DrafterError(
            f"{path} is not the store this checkpoint was trained on ({'; '.join(problems)}); pass "
            "--store with its store, or --allow-mismatch"
        )
    if problems:
        notes.append(
            f"MISMATCH allowed: the target record comes from {path}, not the checkpoint's store ("
            + "; ".join(problems)
            + ")"
        )
    return attrs, None


def _measured(
    config: ExportConfig, src: Path, record: TrainingRecord | None, attrs: StoreAttrs | None, notes: list[str]
) -> Measured:
    """This checkpoint's row of the --report, checked against the checkpoint's store."""
    path = Path(config.report)
    path = path / "report.json" if path.is_dir() else path
    try:
        rep = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError("--report", config.report, f"cannot read {path} ({e.strerror or e})") from None
    except ValueError as e:
        raise ConfigError("--report", config.report, f"{path} is not valid JSON ({e})") from None
    if not isinstance(rep, dict) or rep.get("kind") != REPORT_KIND:
        raise ConfigError("--report", config.report, f"{path} is not an evaluate.py report (kind {REPORT_KIND!r})")
    entry = _entry(config, rep, src)
    theirs = rep.get("store_fingerprint")
    mine, whose = (
        (record.store_fingerprint, "the checkpoint was trained on")
        if record
        else ((attrs.fingerprint, "--store is") if attrs else (None, None))
    )
    problems = []
    if mine is None:
        notes.append(
            f"--report {config.report}: its store could not be compared (the checkpoint records none and "
            "no store was opened)"
        )
    elif theirs != mine:
        problems.append(f"it replayed store {str(theirs)[:12]}, {whose} {mine[:12]}")
    if record is not None and entry.get("step") is not None and entry["step"] != record.step:
        problems.append(f"it measured step {entry['step']}, the checkpoint is step {record.step}")
    if problems and not config.allow_mismatch:
        raise ConfigError(
            "--report",
            config.report,
            "not a report on this checkpoint's store: " + "; ".join(problems) + " (--allow-mismatch to export anyway)",
        )
    if problems:
        notes.append(f"MISMATCH allowed: the tau table of {config.report} " + "; ".join(problems))
    sample = rep.get("sample") or {}
    ci = entry.get("tau_ci95")
    return Measured(
        report=str(config.report),
        name=entry.get("name", str(src)),
        tau=float(entry["tau"]),
        tau_ci95=tuple(ci) if ci else None,
        tau_pooled=entry.get("tau_pooled"),
        ddtree=entry.get("ddtree"),
        ddtree_ci95=entry.get("ddtree_ci95"),
        prompts=entry.get("prompts", sample.get("prompts")),
        available=sample.get("available"),
        shards=rep.get("shards"),
        dtype=sample.get("dtype"),
        store_fingerprint=theirs,
        warnings=tuple(map(str, rep.get("warnings") or ())),
        served=entry.get("served"),
    )


def _entry(config: ExportConfig, rep: dict, src: Path) -> dict:
    """The report's entry for SRC: by resolved path, else by name (`parent/name`, as evaluate.py names it)."""
    entries = [e for e in rep.get("checkpoints") or [] if isinstance(e, dict) and "tau" in e]
    here = src.resolve()
    by_path = [e for e in entries if e.get("path") and Path(e["path"]).resolve() == here]
    by_name = [e for e in entries if e.get("name") in (f"{here.parent.name}/{here.name}", str(src))]
    found = by_path or by_name
    if len(found) == 1:
        return found[0]
    names = ", ".join(f"{e.get('name')} ({e.get('path')})" for e in entries) or "none"
    problem = "has several entries named" if found else "has no entry for"
    raise ConfigError("--report", config.report, f"{problem} checkpoint {src}; its checkpoints: {names}")


def _evaluate_command(config: ExportConfig, record: TrainingRecord | None, src: Path) -> str:
    store = config.store or (record.store if record else None) or "STORE"
    return f"python evaluate.py --store {shlex.quote(store)} --checkpoint {shlex.quote(str(src))}"


def _write(
    dst: Path, drafter: DrafterConfig, tensors: dict, record: TrainingRecord | None, card: str, force: bool
) -> None:
    """OUT_DIR's files into a hidden sibling, then published by a rename (replacing OUT_DIR), OUT_DIR
    checked again first: what another command made there meanwhile is refused, not replaced."""
    where = Path(os.path.abspath(dst))
    tmp = where.with_name(f".{where.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        checkpoint.write(tmp, drafter, tensors, record, dtype=torch.bfloat16)
        (tmp / CARD).write_text(card)
        written = sorted(p.name for p in tmp.iterdir())
        assert written == sorted(FILES), written
        OUTPUT.check(dst, force)
        checkpoint.publish(tmp, where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summary(result: dict) -> str:
    """What was written, for stdout."""
    files = ", ".join(f"{name} ({human_bytes(size)})" for name, size in result["files"].items())
    step = result["step"] if result["step"] is not None else "not recorded"
    tau = f"{result['tau']:.3f}" if result["tau"] is not None else "not measured (no --report)"
    lines = [
        f"exported {result['checkpoint']} -> {result['out']}: {files}",
        f"target: {result['target'] or 'not checked'}; step: {step}; replay tau: {tau}",
    ]
    if result["warnings"]:
        lines.append(f"{len(result['warnings'])} serving caveat(s): see stderr and {result['out']}/{CARD}")
    return "\n".join(lines)
