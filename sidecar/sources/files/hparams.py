"""`--hparams FILE`: a JSON, YAML or TOML config flattened with dots for /hparams (CONTRACT 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sidecar.config import ConfigError

Scalar = str | int | float | bool | None


def load_hparams(path: Path) -> dict[str, Scalar]:
    """Read and flatten `path`; ConfigError naming the file when it cannot be used."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--hparams {path}: cannot read it ({exc.strerror})") from None
    data = _parse(path, raw)
    if not isinstance(data, dict):
        raise ConfigError(f"--hparams {path}: the top level is a {type(data).__name__}, "
                          "not a mapping of names to values")
    try:
        return flatten(data)
    except RecursionError:
        raise ConfigError(f"--hparams {path}: nested too deeply, or a YAML alias refers to "
                          "itself") from None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Nested mappings and lists as dotted keys (`optimizer.lr`, `layers.0`); NaN/inf dropped."""
    flat: dict[str, Scalar] = {}
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, dict | list | tuple):
            flat.update(flatten(value, name + "."))  # type: ignore[arg-type]
        elif isinstance(value, float) and not math.isfinite(value):
            continue
        elif isinstance(value, str | int | float | bool) or value is None:
            flat[name] = value
        else:
            flat[name] = str(value)  # YAML dates and the like
    return flat


def _parse(path: Path, raw: bytes) -> Any:
    suffix = path.suffix.lower()
    kind = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}.get(suffix, "JSON")
    try:
        if suffix == ".toml":
            import tomllib

            return tomllib.loads(raw.decode("utf-8"))
        if suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(raw)
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--hparams {path}: not valid {kind} ({exc})") from None
    except RecursionError:
        raise ConfigError(f"--hparams {path}: {kind} nested too deeply to read") from None
    except Exception as exc:  # yaml.YAMLError and its kin
        raise ConfigError(f"--hparams {path}: not valid {kind} ({exc})") from None
