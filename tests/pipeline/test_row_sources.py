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
        pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=3)  # groups of 3, 3 and 1 rows
    else:
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    rows, _, _ = row_sources.open_rows(str(path), "train")
    assert len(rows) == len(ROWS) and [rows[i] for i in range(len(ROWS))] == ROWS


def test_a_parquet_row_is_read_with_its_batch_only(tmp_path):
    """A process holds a batch of rows decoded, not the file (~20 GB at 2.5M rows) nor a row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows_in = [{"prompt": f"p{i} {i * 7919 % 1000003:07d} " * 100, "response": f"r{i}"} for i in range(20_000)]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows_in), path, row_group_size=15_000)  # groups of 15,000 and 5,000
    group = pq.ParquetFile(path).read_row_group(0).nbytes
    before = pa.total_allocated_bytes()
    rows, _, _ = row_sources.open_rows(str(path), "train")
    assert len(rows) == 20_000 and rows[0] == rows_in[0] and rows[19_999] == rows_in[19_999]
    assert rows[12_345] == rows_in[12_345]
    assert pa.total_allocated_bytes() - before < group / 4  # about a batch of 256 rows, not a group
    assert [rows[i] for i in range(20_000)] == rows_in  # every row, across batch and group boundaries
    back = (19_990, 5, 14_999, 15_000, 0)
    assert [rows[i] for i in back] == [rows_in[i] for i in back]  # and back
    with pytest.raises(IndexError):
        rows[20_000]
