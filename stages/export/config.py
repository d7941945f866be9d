"""Export's settings: every `pipeline export` flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass

from stages.settings import require, setting


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    store: str | None = setting(
        None,
        "Hidden-state store the drafter was trained on: its target record fills the "
        "card's Target section and the serving checks, and its fingerprint must match "
        "the checkpoint's. If it cannot be opened the export goes on, and the card "
        "and the warnings say the target checks were skipped.",
        default_text="the store recorded in the checkpoint",
    )
    report: str | None = setting(
        None,
        "An evaluate.py report (its directory or report.json): this checkpoint's replay tau table goes into the card.",
        default_text="none (the card says tau was not measured)",
    )
    force: bool = setting(
        False,
        "Replace an earlier export in OUT_DIR. A directory holding anything else (a store, a "
        "run, other files) is refused, --force or not.",
    )
    allow_mismatch: bool = setting(
        False,
        "Export even when --store or --report was made from another store than "
        "the checkpoint records (the card says so).",
    )

    def __post_init__(self) -> None:
        require(self, "store", self.store is None or self.store.strip() != "", "give a store path")
        require(self, "report", self.report is None or self.report.strip() != "", "give a report path")
