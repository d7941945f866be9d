"""Stage two: train a drafter from the store (train.py runs `run.run`; run.py is the training loop).

How a sample travels from the store to a batch, file by file, in order:

1. setup.py opens the store, once per process, with the run's node cache (--cache-dir); the main
   process reads every chosen shard's per-sample arrays (its index file, or the shards'), which
   every rank receives (ranks.py); shard_schedule.py says which shards each epoch takes (fixed at
   launch, --follow, --shard-schedule).
2. samples.py: those arrays -> `Refs`, the trainable samples (shard, index, length) as arrays.
3. epoch_order.py: an epoch's order of the refs (node_order.py for --data-order node), cut into
   rows (packing.py for --batching packed) and batches (`Batches`); position.py deals the part of
   the epoch still to come to the launch's ranks, so each rank has its own batches.
4. loader.py: a rank's batches go, one by one, to --workers worker processes, kept for the run.
5. dataset.py: in a worker (or in the process, with --workers 0), a batch's refs -> a padded
   `Batch` of tokens, loss mask and tap states, read from the store (a worker opens its own).
6. step.py: a batch -> the loss (run.py steps on it); validation.py reads the held-out samples
   through the same loader and store.
"""
