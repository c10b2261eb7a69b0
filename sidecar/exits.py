"""How a command ends: the exit statuses of the sidecar's commands, each defined once
(docs/commands.md#exit-statuses; each command's `--help` ends with its own), and `ConfigError`, the
mistake that ends one with EXIT_CONFIG before anything starts."""

from __future__ import annotations

import re

from sidecar.masking import mask

EXIT_OK = 0
EXIT_FAILED = 1  # `check`: a step failed
EXIT_NO_ANSWER = 1  # `status`, `stacks`: no sidecar answered
EXIT_REFUSED = 1  # `lifecycle`: the event refused, or not acknowledged in time
EXIT_CONFIG = 2  # every command: a configuration error, nothing started
EXIT_AMBIGUOUS = 2  # `status`, `stacks`: more than one sidecar could be meant
EXIT_CANNOT_LOOK = 3  # `stacks`: the sidecar answered but could not read the stacks
EXIT_CANNOT_START = 127  # `run`: the command could not be started (a shell's status)
EXIT_SIGNAL_BASE = 128  # `run`: the command died of signal N, status 128+N (a shell's convention)

# the option (`--status-addr`) or variable (`STARFORGE_TOKEN`) a problem starts by naming
_CULPRIT = re.compile(r"(--[a-z][a-z-]*|[A-Z][A-Z0-9]*_[A-Z0-9_]+)\b")


class ConfigError(Exception):
    """A configuration mistake: the message names the option or variable, the value and the fix.
    Any secret known (`sidecar.log.add_secret`) is masked in it, wherever the value came from.
    `resolve` raises one holding every mistake it found (`problems`, worst first), so that a
    user fixes them all in one round trip, not one a start."""

    def __init__(self, *problems: str) -> None:
        super().__init__(*problems)
        self.problems: tuple[str, ...] = problems

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return mask(self.problems[0])
        return mask("; ".join(f"({i}) {p}" for i, p in enumerate(self.problems, 1)))

    @property
    def said(self) -> str:
        """The one line that says them: "configuration error: ...", or "3 configuration
        errors, all found at once: (1) ...; (2) ...; (3) ..."."""
        if len(self.problems) == 1:
            return f"configuration error: {self}"
        return f"{len(self.problems)} configuration errors, all found at once: {self}"

    @property
    def concerns(self) -> dict[str, str]:
        """The option or variable the first problem is about, as a JSON message's field: each
        problem starts by naming its culprit (`--status-addr nowhere: ...`, `STARFORGE_TOKEN is
        not set`)."""
        culprit = _CULPRIT.match(self.problems[0]) if self.problems else None
        if culprit is None:
            return {}
        name = culprit.group(1)
        return {"option": name} if name.startswith("--") else {"variable": name}
