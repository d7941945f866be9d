"""--cache-dir and --cache-size, shared by train.py and evaluate.py: a node-local cache of an
object-store --store (store/io/node_cache.py), made from them."""

from __future__ import annotations

from stages.settings import flag_of, format_size, parse_size, require, setting
from store.errors import ConfigError
from store.io.node_cache import NodeCache


def cache_dir_setting():
    return setting(
        None,
        "Node-local cache directory for an object-store --store: each shard file is fetched once "
        "per node, kept here (whole, renamed into place) and read from the node's disk after; "
        "shared by the node's processes, bounded by --cache-size (least recently used files "
        "evicted), every read still verified. A local --store ignores it.",
        default_text="off",
    )


def cache_size_setting():
    return setting(
        None,
        "Bytes the --cache-dir may hold, e.g. '500G' or '20T' (powers of 1024); required with "
        "--cache-dir. Leave the disk some room: files being fetched sit beside the bound.",
        parse=parse_size,
        default_text="none",
    )


def check(config) -> None:
    """A cache size exactly when a cache directory, positive."""
    require(
        config,
        "cache_size",
        config.cache_size is not None or config.cache_dir is None,
        "is required with --cache-dir (e.g. --cache-size 500G)",
    )
    if config.cache_size is None:
        return
    shown = format_size(config.cache_size)  # as the user wrote it (1G, not 1073741824)
    if config.cache_dir is None:
        raise ConfigError(flag_of(config, "cache_size"), shown, "is only used with --cache-dir")
    if config.cache_size <= 0:
        raise ConfigError(flag_of(config, "cache_size"), shown, "must be positive")


def make(config, warn=None) -> NodeCache | None:
    """The node-local cache the config asks for, or None. warn: told once, in a line, when the cache
    cannot be written and reads go on without it (store/io/node_cache.py); nothing is made on disk
    before the first file is fetched."""
    return None if config.cache_dir is None else NodeCache(config.cache_dir, config.cache_size, warn)


def warning(config, store) -> str | None:
    """What to say when --cache-dir is given for a store it does not apply to (a local one)."""
    if config.cache_dir is not None and store.local:
        return f"--cache-dir {config.cache_dir} is not used: --store {config.store} is on a local file system already"
    return None
