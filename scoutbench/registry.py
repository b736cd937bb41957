"""A small lazy registry: names map to "module:Attr" strings imported on first use (as in lm-eval-harness),
so listing methods never imports heavy code, and unknown names get a "did you mean" hint."""

from __future__ import annotations

import contextlib
import difflib
import importlib
from collections.abc import Iterator
from typing import Any

from scoutbench.errors import UsageError


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._targets: dict[str, str | Any] = {}
        self._presets: dict[str, dict[str, Any]] = {}
        self._canonical: dict[str, str] = {}

    def register(self, name: str, target: str | Any, *aliases: str, preset: dict[str, Any] | None = None) -> None:
        """Register `name` (plus aliases) for `module:Attr` (imported on first use) or an object itself; `preset`
        fixes some fields (ablation variants)."""
        for key in (name, *aliases):
            if key in self._targets:
                raise ValueError(f"{self.kind} {key!r} is registered twice")
            self._targets[key] = target
            self._presets[key] = dict(preset or {})
            self._canonical[key] = name

    @contextlib.contextmanager
    def scoped(self) -> Iterator[Registry]:
        """Registrations made inside the block are undone when it ends (tests register toy entries this way)."""
        saved = dict(self._targets), dict(self._presets), dict(self._canonical)
        try:
            yield self
        finally:
            self._targets, self._presets, self._canonical = saved

    def names(self) -> list[str]:
        """Canonical names, in registration order."""
        return list(dict.fromkeys(self._canonical.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def canonical(self, name: str) -> str:
        self._check(name)
        return self._canonical[name]

    def preset(self, name: str) -> dict[str, Any]:
        self._check(name)
        return dict(self._presets[name])

    def load(self, name: str) -> Any:
        self._check(name)
        target = self._targets[name]
        if not isinstance(target, str):
            return target
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def _check(self, name: str) -> None:
        if name in self._targets:
            return
        close = difflib.get_close_matches(name, list(self._targets), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"unknown {self.kind} {name!r}{hint} (known: {', '.join(self.names())})")
