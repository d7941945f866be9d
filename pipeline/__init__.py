"""dflash-pipeline: train DFlash drafters from an offline store of target hidden states."""

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
TINY_TARGET = ASSETS / "tiny_target"
DEFAULT_PROMPTS = ASSETS / "prompts.jsonl"
