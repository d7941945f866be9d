"""The flag tables in docs/ state the same defaults as the config dataclasses (the one source), and
README's commands use flags that exist."""

import dataclasses
import re

import pytest

from stages.evaluate.config import EvalConfig
from stages.settings import flag_of
from stages.train.config import TrainConfig
from tests.conftest import REPO

ROW = re.compile(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]+) \|", re.M)


def documented(doc: str) -> dict[str, str]:
    """{flag: default as written} from the rows of doc's `| flag | default | meaning |` tables."""
    return {flag: default.strip() for flag, default in ROW.findall((REPO / "docs" / doc).read_text())}


def reads_as(field: dataclasses.Field, text: str) -> bool:
    text = text.replace("`", "")
    if field.metadata.get("default_text"):
        return text == field.metadata["default_text"]
    if field.default is None:
        return text == "none"
    if field.default is False:
        return text == "off"
    if isinstance(field.default, tuple):
        return text == ",".join(map(str, field.default))
    if isinstance(field.default, (int, float)):
        return float(text) == field.default
    return text == str(field.default)


@pytest.mark.parametrize("doc,config_cls", [("training.md", TrainConfig), ("evaluation.md", EvalConfig)])
def test_flag_tables_state_the_configs_defaults(doc, config_cls):
    rows = documented(doc)
    fields = {flag_of(config_cls, f.name): f for f in dataclasses.fields(config_cls)}
    checked = [flag for flag in rows if flag in fields and fields[flag].default is not dataclasses.MISSING]
    assert len(checked) >= 8, rows
    wrong = {flag: rows[flag] for flag in checked if not reads_as(fields[flag], rows[flag])}
    assert wrong == {}


def mapped_files(doc: str) -> set[str]:
    """Every file the code map of doc names: `dir/a.py`, and a bare `b.py` after it in the same
    row as dir/b.py."""
    names = set()
    for line in doc.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([\w./]+\.py)`", line):
            if "/" in name:
                folder = name.rsplit("/", 1)[0]
            names.add(name if "/" in name or not folder else f"{folder}/{name}")
    return names


def test_every_production_module_is_in_the_code_map():
    from tests.test_layers import production_files

    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = [p.relative_to(REPO).as_posix() for p in production_files(REPO)
               if p.name != "__init__.py" and p.relative_to(REPO).as_posix() not in mapped_files(doc)]
    assert missing == [], f"docs/architecture.md's code map lacks {missing}"
