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
