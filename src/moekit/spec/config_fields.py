"""A `config.json` read the way transformers reads it, with errors a user can act on.

A field missing from the file takes the family's transformers default (the dataclass default in its
`configuration_*.py`); a field with no default is required. Values are type-checked on read, so a
bad field is reported by name, once, before anything is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from moekit.errors import SpecError


@dataclass(frozen=True)
class ConfigFields:
    raw: Mapping[str, object]
    defaults: Mapping[str, object]
    family: str
    # transformers' `attribute_map`: a key the file may use for a field stored under another name.
    aliases: Mapping[str, str] = field(default_factory=dict)

    def _lookup(self, key: str) -> tuple[bool, object]:
        if key in self.raw:
            return True, self.raw[key]
        for alias, target in self.aliases.items():
            if target == key and alias in self.raw:
                return True, self.raw[alias]
        if key in self.defaults:
            return True, self.defaults[key]
        return False, None

    def has(self, key: str) -> bool:
        """Whether the file itself states the field (defaults do not count)."""
        return key in self.raw or any(t == key and a in self.raw for a, t in self.aliases.items())

    def get(self, key: str) -> object:
        found, value = self._lookup(key)
        if not found:
            raise SpecError(f"{self.family} config has no '{key}' (required)")
        return value

    def opt_int(self, key: str) -> Optional[int]:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise SpecError(f"{self.family} config: '{key}' must be an integer, got {value!r}")
        return int(value)

    def int(self, key: str) -> int:
        value = self.opt_int(key)
        if value is None:
            raise SpecError(f"{self.family} config: '{key}' must be an integer, got null")
        return value

    def size(self, key: str) -> int:
        """A dimension or count that must be positive."""
        value = self.int(key)
        if value <= 0:
            raise SpecError(f"{self.family} config: '{key}' must be positive, got {value}")
        return value

    def opt_size(self, key: str) -> Optional[int]:
        value = self.opt_int(key)
        if value is not None and value <= 0:
            raise SpecError(f"{self.family} config: '{key}' must be positive, got {value}")
        return value

    def opt_float(self, key: str) -> Optional[float]:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{self.family} config: '{key}' must be a number, got {value!r}")
        return float(value)

    def float(self, key: str) -> float:
        value = self.opt_float(key)
        if value is None:
            raise SpecError(f"{self.family} config: '{key}' must be a number, got null")
        return value

    def bool(self, key: str) -> bool:
        value = self.get(key)
        if value is None:
            return False
        if not isinstance(value, (bool, int)):
            raise SpecError(f"{self.family} config: '{key}' must be true or false, got {value!r}")
        return bool(value)

    def str(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise SpecError(f"{self.family} config: '{key}' must be a string, got {value!r}")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.get(key)
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise SpecError(f"{self.family} config: '{key}' must be a list of integers, got {value!r}")
        return tuple(value)

    def str_list(self, key: str) -> Optional[tuple[str, ...]]:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise SpecError(f"{self.family} config: '{key}' must be a list of strings, got {value!r}")
        return tuple(value)

    def sub(self, key: str, defaults: Mapping[str, object], family: Optional[str] = None) -> "ConfigFields":
        """A nested dict (dbrx's attn_config, llama4's text_config) read with its own defaults."""
        value = self.get(key)
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise SpecError(f"{self.family} config: '{key}' must be an object, got {value!r}")
        return ConfigFields(value, defaults, family or f"{self.family}.{key}")
