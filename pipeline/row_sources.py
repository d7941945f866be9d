"""Where prompt rows are read from, lazily: a process decodes only the rows it asks for.

At 2.5M rows a dataset decoded whole is tens of GB of Python objects, in every process. A .jsonl
file is scanned once for the byte offset of each row and a row is parsed when asked for; a
.parquet file is streamed in batches of rows and a row converted when asked for; a `datasets` dataset is
indexed as it is (Arrow underneath). A .json file (one array) has to be parsed whole.
"""

from __future__ import annotations

import bisect
import json
from array import array
from pathlib import Path

from pipeline import fingerprint
from pipeline.errors import DatasetError


def open_rows(source: str, split: str):
    """(rows, name, sha256): rows a sequence of dicts (len, [i]), name the source as recorded,
    sha256 the data's identity."""
    path = Path(source).expanduser()
    if path.is_file():
        suffix = "".join(path.suffixes[-1:]).lower()
        readers = {".jsonl": JsonlRows, ".json": _read_json, ".parquet": ParquetRows}
        if suffix not in readers:
            raise DatasetError(f"--dataset {path}: unknown file type {suffix!r}; expected .jsonl, .json or .parquet")
        return readers[suffix](path), str(path), fingerprint.sha256_file(path)
    if path.is_dir() or source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".parquet")):
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
            return _from_datasets(str(path), split, on_disk=True)
        raise DatasetError(f"--dataset {source}: no such file (or not a saved `datasets` directory)")
    return _from_datasets(source, split, on_disk=False)


class JsonlRows:
    """The non-empty lines of a .jsonl file, each parsed when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offsets, self.lines = array("q"), array("q")  # byte offset and line number of each row
        pos = 0
        with path.open("rb") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    self.offsets.append(pos)
                    self.lines.append(n)
                pos += len(line)
        self._fh = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> dict:
        if self._fh is None:
            self._fh = self.path.open("rb")
        self._fh.seek(self.offsets[i])
        line = self._fh.readline()
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(
                f"--dataset {self.path}: line {self.lines[i]} is not valid JSON ({getattr(e, 'msg', e)})"
            ) from None
        if not isinstance(rec, dict):
            raise DatasetError(f"--dataset {self.path}: line {self.lines[i]} is not a JSON object")
        return rec


class ParquetRows:
    """The rows of a .parquet file, streamed in record batches: a process holds the batch it is
    in, never a row group decoded (pyarrow writes groups of up to 1M rows: GBs at prompt sizes).
    Rows asked for in order (a shard's rows are consecutive) are decoded once; a row before the
    current batch restarts the stream at the start of its row group."""

    BATCH = 256  # rows decoded at a time

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        self.path = path
        try:
            self.file = pq.ParquetFile(path, memory_map=True)
        except Exception as e:
            raise DatasetError(f"--dataset {path}: cannot read parquet ({e})") from None
        meta = self.file.metadata
        self.starts = array("q", [0])  # first row of each row group, then the row count
        for g in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
        self._group, self._stream, self._batch, self._at, self._next = -1, None, None, 0, 0

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        if self._batch is None or not self._at <= i < self._at + self._batch.num_rows:
            try:
                self._seek(i)
            except Exception as e:
                self._group, self._batch = -1, None
                raise DatasetError(f"--dataset {self.path}: cannot read row {i} ({e})") from None
        return self._batch.slice(i - self._at, 1).to_pylist()[0]

    def _seek(self, i: int) -> None:
        """Move the stream on to the batch that holds row i."""
        g = bisect.bisect_right(self.starts, i) - 1
        if g != self._group or i < self._at:
            self._group, self._next, self._batch = g, self.starts[g], None
            self._stream = self.file.iter_batches(batch_size=self.BATCH, row_groups=[g], use_threads=False)
        while self._batch is None or i >= self._at + self._batch.num_rows:
            self._batch = None  # freed before the next is decoded
            batch = next(self._stream)
            self._batch, self._at, self._next = batch, self._next, self._next + batch.num_rows


def _read_json(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"--dataset {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DatasetError(f"--dataset {path}: expected a JSON list of objects")
    return data


def _from_datasets(name: str, split: str, on_disk: bool):
    import datasets

    try:
        ds = datasets.load_from_disk(name) if on_disk else datasets.load_dataset(name, split=split)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    except Exception as e:
        raise DatasetError(
            f"--dataset {name}: cannot load it with `datasets` ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return ds, name, fingerprint.sha256_json({"fingerprint": ds._fingerprint, "rows": len(ds)})
