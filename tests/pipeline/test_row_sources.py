"""Rows are read lazily and the same from every kind of source."""

import json

import pytest

from pipeline import row_sources
from pipeline.errors import DatasetError

ROWS = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(7)]


def test_jsonl_rows_are_parsed_only_when_asked_for(tmp_path):
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(r) for r in ROWS]
    lines.insert(2, "")  # blank lines are not rows
    lines[5] = "{not json"  # row 4, line 6
    path.write_text("\n".join(lines) + "\n")
    rows, name, sha = row_sources.open_rows(str(path), "train")
    assert len(rows) == 7 and name == str(path) and len(sha) == 64
    assert [rows[i] for i in (0, 1, 2, 3, 5, 6)] == [ROWS[i] for i in (0, 1, 2, 3, 5, 6)]
    with pytest.raises(DatasetError, match=r"line 6 is not valid JSON"):
        rows[4]


@pytest.mark.parametrize("kind", ["json", "parquet", "datasets"])
def test_every_source_gives_the_same_rows(tmp_path, kind):
    if kind == "json":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(ROWS))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    rows, _, _ = row_sources.open_rows(str(path), "train")
    assert len(rows) == len(ROWS) and [rows[i] for i in range(len(ROWS))] == ROWS
