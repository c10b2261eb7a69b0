"""What `sidecar check` found, step by step: each step printed as soon as it is known, or
everything at the end as one JSON document, and the verdict that ends it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from sidecar.commands import print_out
from sidecar.config import Config
from sidecar.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from sidecar.masking import mask


@dataclass
class Step:
    """One step's finding: status is ok, warn (worth knowing, not fatal), fail or skip."""

    name: str
    status: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


class CheckReport:
    """Prints each step as it is found (text), or everything at the end as one JSON document."""

    def __init__(self, as_json: bool, out: TextIO) -> None:
        self.as_json = as_json
        self.out = out
        self.steps: list[Step] = []

    def add(self, name: str, status: str, message: str, **details: Any) -> Step:
        step = Step(name, status, message, details)
        self.steps.append(step)
        if not self.as_json:
            label = "FAIL" if status == "fail" else status
            self._print(f"{label:<5} {name:<13} {message}")
        return step

    @property
    def failed(self) -> bool:
        return any(step.status == "fail" for step in self.steps)

    @property
    def warned(self) -> list[str]:
        """The steps that warned, each named once."""
        return list(dict.fromkeys(step.name for step in self.steps if step.status == "warn"))

    def finish(self, code: int, cfg: Config | None) -> None:
        verdict = {EXIT_OK: "ok", EXIT_FAILED: "failed", EXIT_CONFIG: "configuration error"}
        if self.as_json:
            doc = {
                "ok": code == EXIT_OK,
                "exit_status": code,
                "result": verdict[code],
                "endpoint": cfg.platform.endpoint if cfg else None,
                "run_id": cfg.platform.run_id if cfg else None,
                "warnings": self.warned,
                "steps": [asdict(step) for step in self.steps],
            }
            self._print(json.dumps(doc, indent=2, ensure_ascii=False))
            return
        failures = [s.name for s in self.steps if s.status == "fail"]
        # each failed step once, with how many times it failed, in the order found
        failed = [name + (f" ({failures.count(name)})" if failures.count(name) > 1 else "")
                  for name in dict.fromkeys(failures)]
        if not failed and self.warned:
            self._print(f"sidecar check: ok, with warnings ({', '.join(self.warned)})")
        elif not failed:
            self._print("sidecar check: ok")
        elif len(failures) == 1 and not self.warned:
            self._print(f"sidecar check: {verdict[code]} (first failed step: {failed[0]})")
        else:
            # every problem, worst first: the failed steps (the configuration's lead, being
            # found first), then those that only warned
            warned = [name for name in self.warned if name not in failures]
            also = f"; warnings: {', '.join(warned)}" if warned else ""
            self._print(f"sidecar check: {verdict[code]} (failed: {', '.join(failed)}{also})")

    def _print(self, text: str) -> None:
        print_out(mask(text), self.out)
