"""Stage settings: config fields that carry their own help, and checks that name the flag.

Each stage's config is a frozen, keyword-only dataclass whose fields are made by `setting`: the
default and the help text live there and nowhere else. The command line is generated from those
fields (stages/command.py), and `__post_init__` validates with the helpers below, so a bad value
is refused the same way from the command line, from Python, and from a resumed run.

A stage with many settings is made of component configs (`part`: TrainConfig's data, optimizer,
loss ...), each with its own settings and checks; the stage's flags are then every component's
settings (`leaves`), each named once, and `build` / `flat` go between the config and the flat
{setting: value} of its flags and records.
"""

from __future__ import annotations

import dataclasses
import math

from store.errors import ConfigError


def setting(
    default=dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    default_text: str | None = None,
    choices: tuple | None = None,
    parse=None,
    click: dict | None = None,
    resume: str | None = None,
    drafter: str | None = None,
) -> dataclasses.Field:
    """A config field. flag: the option's name when it is not `--field-name`; default_text: how the
    default reads in --help when the value itself says little (None meaning "auto"); choices: the
    allowed values; parse: text -> value, for fields a single option string cannot hold as is;
    click: any further click.option arguments. Roles: resume="fixed": a resumed run must keep the
    value (training); drafter: the DrafterConfig field the value sets, when given (training)."""
    meta = {
        "help": help,
        "flag": flag,
        "default_text": default_text,
        "choices": choices,
        "parse": parse,
        "click": click or {},
        "resume": resume,
        "drafter": drafter,
    }
    return dataclasses.field(default=default, metadata=meta)


def part(config_cls) -> dataclasses.Field:
    """A field holding a component's config (a config of `setting` fields) inside a stage's config: its
    settings are the stage's flags, as if they were the stage's own fields (`leaves`)."""
    return dataclasses.field(default_factory=config_cls, metadata={"part": config_cls})


def parts(config_cls) -> dict[str, type]:
    """{field name: component config class} for the `part` fields of config_cls (none for a flat config)."""
    return {f.name: f.metadata["part"] for f in dataclasses.fields(config_cls) if f.metadata.get("part")}


def leaves(config_cls) -> dict[str, dataclasses.Field]:
    """{name: field} of every setting of config_cls, its components' included, in field order: the
    stage's flags. A name is unique across the components (it is the flag, and the record's key)."""
    out = {}
    for f in dataclasses.fields(config_cls):
        found = leaves(f.metadata["part"]) if f.metadata.get("part") else {f.name: f}
        assert not set(found) & set(out), sorted(set(found) & set(out))
        out.update(found)
    return out


def owner_of(config_cls, name: str) -> type:
    """The config class (config_cls or one of its components) that holds setting `name` (a component
    may be named as one of its settings is: TrainConfig.shard_schedule holds --shard-schedule)."""
    if name in {f.name for f in dataclasses.fields(config_cls) if not f.metadata.get("part")}:
        return config_cls
    return next(owner_of(c, name) for c in parts(config_cls).values() if name in leaves(c))


def build(config_cls, values: dict):
    """config_cls from {setting name: value} (the flags' values, or a flat record): each component
    made from its own settings; a name given that is no setting of config_cls is a TypeError."""
    unknown = set(values) - set(leaves(config_cls))
    if unknown:
        raise TypeError(f"{config_cls.__name__} has no setting {', '.join(sorted(unknown))}")
    kw = {}
    for f in dataclasses.fields(config_cls):
        if f.metadata.get("part"):
            mine = {k: v for k, v in values.items() if k in leaves(f.metadata["part"])}
            kw[f.name] = build(f.metadata["part"], mine)
        elif f.name in values:
            kw[f.name] = values[f.name]
    return config_cls(**kw)


def flat(config) -> dict:
    """{setting name: value} of a config and its components: the flat record a run keeps."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out.update(flat(value) if f.metadata.get("part") else {f.name: value})
    return out


def with_role(config_cls, role: str) -> dict[str, str]:
    """{field name: its role's value} for the settings of config_cls (its components' included) that
    carry `role` (setting's roles)."""
    return {name: f.metadata[role] for name, f in leaves(config_cls).items() if f.metadata.get(role)}


def flag_of(config, name: str) -> str:
    """The command-line flag of setting `name` of a config (class or instance; a component's setting
    through the config holding it)."""
    f = leaves(config if isinstance(config, type) else type(config))[name]
    return f.metadata.get("flag") or "--" + name.replace("_", "-")


def require(config, name: str, ok: bool, problem: str) -> None:
    """Refuse the value of field `name` unless ok; the error names its flag and value."""
    if not ok:
        raise ConfigError(flag_of(config, name), getattr(config, name), problem)


def at_least(config, low, *names: str) -> None:
    """Each named field, when set, must be >= low."""
    for name in names:
        value = getattr(config, name)
        require(config, name, value is None or value >= low, f"must be at least {low}")


def check_choices(config) -> None:
    """Every field declared with choices holds one of them (or None, where None is its default: off)."""
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        if choices and not (f.default is None and getattr(config, f.name) is None):
            require(config, f.name, getattr(config, f.name) in choices, f"expected one of {', '.join(choices)}")


def fill(config, name: str, value) -> None:
    """Resolve an "auto" field of a frozen config in __post_init__ (None -> its concrete value)."""
    object.__setattr__(config, name, value)


def parse_count(text: str) -> int | None:
    """'2000' -> 2000; 'all' -> None (no limit)."""
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError("expected a number or 'all'") from None


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str) -> int:
    """'500G' -> 500 x 2^30 bytes; '2T', '1.5T', '800M', '4096' (bytes); a trailing 'B' or 'iB' allowed
    ('500GB', '500GiB': the same, in powers of 1024, as df -h counts). A whole number of bytes, finite
    and not negative ('inf', 'nan', '0.5' and '-1G' are refused)."""
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = body[-1:] if body[-1:] in _SIZE_UNITS and body[-1:] else ""
    try:
        value = float(body[: len(body) - len(unit)])
    except ValueError:
        raise ValueError("expected a size such as '500G', '2T' or a number of bytes") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected a size such as '500G', '2T' or a number of bytes, finite and at least 0")
    size = value * _SIZE_UNITS[unit]
    if size != int(size):
        raise ValueError(f"is {size:g} bytes: expected a whole number of bytes")
    return int(size)


def format_size(size: int) -> str:
    """A size as a person writes it, in the largest unit that shows it exactly: 1073741824 -> '1G',
    3 x 2^39 -> '1.5T', 1000 -> '1000' (bytes); parse_size reads it back."""
    for unit, scale in sorted(_SIZE_UNITS.items(), key=lambda u: -u[1]):
        if unit and size >= scale and (size * 1000) % scale == 0:  # bytes: as a whole number (not 1.09951e+12)
            return f"{size / scale:g}{unit}"
    return str(size)
