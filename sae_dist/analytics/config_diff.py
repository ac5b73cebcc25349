"""What differs between the configurations of the runs compared: one row per config key whose
value is not the same in all of them (nested keys dotted: "lr_schedule.warmup").

Pure functions of the parsed configs (`queries.get_run_summary(...)["config"]`). A key one run
does not have reads NOT_SET, which differs from every value, None included.
"""

from __future__ import annotations

import json
from typing import Any

NOT_SET = "(not set)"

_ABSENT = object()


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level with dotted keys; lists and other values stay whole."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def value_text(value: Any) -> str:
    """A config value as the table shows it: strings as they are, the rest as JSON."""
    if value is _ABSENT:
        return NOT_SET
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _same(a: Any, b: Any) -> bool:
    """Equal as Python compares them (1 == 1.0: the same number), but True is not 1."""
    if a is _ABSENT or b is _ABSENT:
        return a is b
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def config_diff(configs: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """Rows {"key": ..., <run label>: value text, ...} for the keys whose values differ among
    `configs` (run label -> config), sorted by key; [] for fewer than two configs."""
    if len(configs) < 2:
        return []
    flat = {label: flatten(config) for label, config in configs.items()}
    keys = sorted(set().union(*(f.keys() for f in flat.values())))
    rows = []
    for key in keys:
        values = [f.get(key, _ABSENT) for f in flat.values()]
        if any(not _same(v, values[0]) for v in values[1:]):
            rows.append({"key": key, **{label: value_text(v) for label, v in zip(flat, values)}})
    return rows
