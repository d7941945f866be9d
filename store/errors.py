"""The project's user-facing errors. They live in the bottom layer so that every layer can raise them.

    UserError                  a mistake in the user's input or environment; one line at the command line
    ├── ConfigError            a bad setting: names the flag (or field), the value and what was expected
    ├── StoreError             a store that cannot be used as asked; names its location
    │   ├── NotAStore          no root commit, or root attributes this tool cannot read
    │   ├── NotCommitted       a shard that is not committed (missing, or half-written by a crash)
    │   ├── StoreMismatch      a run whose settings differ from the ones the store was made with
    │   └── StoreCorrupt       data that does not match its commit record
    └── (pipeline.errors)      the domain's: target, dataset, drafter checkpoint

Internal invariants are asserts, not these.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input or environment. The message names what and where."""


class ConfigError(UserError):
    """A bad setting, named as the user gave it: `--flag value: what is wrong`."""

    def __init__(self, flag: str, value, problem: str) -> None:
        self.flag, self.value, self.problem = flag, value, problem
        shown = repr(value) if isinstance(value, str) and not value.strip() else value  # blank text, quoted
        super().__init__(f"{flag} {shown}: {problem}" if value is not None else f"{flag}: {problem}")


class StoreError(UserError):
    """A store that cannot be used as asked. The message starts with the store's location."""


class NotAStore(StoreError):
    """The location holds no store this tool made (or one whose root it cannot read)."""


class NotCommitted(StoreError):
    """A shard that has no commit file: absent, or left half-written by a crash."""


class StoreMismatch(StoreError):
    """A run whose settings differ from those the store was made with."""


class StoreCorrupt(StoreError):
    """Stored data that contradicts its commit record (shape, checksum). `damage` names the file and
    what is wrong with it; `fix`, when known, says what to run."""

    def __init__(self, damage: str, fix: str | None = None) -> None:
        self.damage, self.fix = damage, fix
        super().__init__(damage if fix is None else f"{damage}; {fix}")

    def located(self, where: str | None, fix: str) -> "StoreCorrupt":
        """The same damage, with where it lies (in parentheses after it) and what to run about it."""
        return StoreCorrupt(self.damage if where is None else f"{self.damage} ({where})", fix)


# What to run about damage, named in the errors above.
ROOT_FIX = (
    "the store's root is damaged (zarr.json, target/ or _commits/root.json; the shards are separate "
    "and `pipeline verify` checks them): rebuild it with `pipeline extract ... --redo` and the settings the "
    "store was made with, --num-shards included, or restore those files from a copy"
)


def redo_hint(location: str, shard: int) -> str:
    """What to run about a damaged shard of the store at location."""
    return (
        f"run `pipeline verify {location} --shards {shard}`, then re-extract it with the store's "
        f"settings (`pipeline info` shows them) and `--shards {shard} --redo`"
    )
