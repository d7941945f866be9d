"""The on-disk format, knowing no model. Two rooms side by side: store/format/ (what the bytes
mean) and store/io/ (how they move and are guarded), neither importing the other; under both the
errors (errors.py); above both the store opened to read (hidden_store.py and its
readers: shard_reader, span_reader, sample_index, index_file, summary, verify) or to write
(store_writer.py, shard_writer.py: extraction alone).
"""
