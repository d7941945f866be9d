"""What the store's bytes mean, apart from how they move: the layout (array names, dtypes, chunk
keys, codec chains), the hidden formats and their zarr codecs (bf16 byte planes, fp8), the typed
records (root attributes, commit files), the format revisions and what reading each checks, and the
decoders of whole shard files and per-sample arrays, and shard range text ("0-3,8"). No module here
reads or writes a file, and none imports store/io/ (tests/test_layers.py); the readers and writers
in store/ sit above both.
"""
