"""How the store's bytes move and are guarded, apart from what they mean: byte ranges fetched in
batches, the read cache and the node-local cache, commit files written last and atomically, zarr's
files fetched for it, locks and leases (local files, S3 conditional writes), file modes, and an
object store's failures in one line. No module here knows the format, and none imports
store/format/ (tests/test_layers.py); the readers and writers in store/ sit above both.
"""
