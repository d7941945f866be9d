"""--cache-dir and --cache-size, shared by train.py and evaluate.py: a node-local cache of an
object-store --store (store/io/node_cache.py), made from them. The bound is the directory's: the
first process's --cache-size, recorded there; a later one that differs is said and not applied."""

from __future__ import annotations

from stages.settings import flag_of, format_size, parse_size, setting
from store.errors import ConfigError
from store.io.node_cache import NodeCache, recorded_bound


def cache_dir_setting():
    return setting(
        None,
        "Node-local cache directory for an object-store --store: each shard file is fetched once "
        "per node, kept here (whole, renamed into place) and read from the node's disk after; "
        "shared by the node's processes, bounded by the size the directory records (least recently "
        "used files evicted), every read still verified. A local --store ignores it.",
        default_text="off",
    )


def cache_size_setting():
    return setting(
        None,
        "Bytes the --cache-dir may hold, e.g. '500G' or '20T' (powers of 1024). The first process "
        "that uses a directory records its size there (DIR/bound.json) and every later one keeps to "
        "it: a different --cache-size is not applied (a warning says so), so no process evicts "
        "another's files below that bound. Required for a directory that records none; to change "
        "it, delete DIR/bound.json while no process uses the directory. Leave the disk some room: "
        "files being fetched sit beside the bound.",
        parse=parse_size,
        default_text="the directory's",
    )


def check(config) -> None:
    """A cache size only with a cache directory, positive. (Whether the directory records one when
    none is given is seen when the cache is made.)"""
    if config.cache_size is None:
        return
    shown = format_size(config.cache_size)  # as the user wrote it (1G, not 1073741824)
    if config.cache_dir is None:
        raise ConfigError(flag_of(config, "cache_size"), shown, "is only used with --cache-dir")
    if config.cache_size <= 0:
        raise ConfigError(flag_of(config, "cache_size"), shown, "must be positive")


def make(config, warn=None) -> NodeCache | None:
    """The node-local cache the config asks for, or None: bounded by what the directory records, else
    by --cache-size (recorded there when the first file is fetched). warn: told once, in a line, when
    the cache cannot be written and reads go on without it, or when another process recorded another
    bound first (store/io/node_cache.py); nothing is made on disk before the first file is fetched."""
    if config.cache_dir is None:
        return None
    size = config.cache_size if config.cache_size is not None else recorded_bound(config.cache_dir)
    if size is None:
        raise ConfigError(
            flag_of(config, "cache_size"),
            None,
            f"is required with --cache-dir {config.cache_dir}, which records no bound yet (a new cache "
            "directory): e.g. --cache-size 500G",
        )
    return NodeCache(config.cache_dir, size, warn)


def warning(config, store) -> str | None:
    """What to say about the cache as a run starts: --cache-dir given for a store it does not apply to
    (a local one), or a --cache-size the directory's recorded bound overrules."""
    if config.cache_dir is not None and store.local:
        return f"--cache-dir {config.cache_dir} is not used: --store {config.store} is on a local file system already"
    return store.node.cache.overruled() if store.node is not None else None
