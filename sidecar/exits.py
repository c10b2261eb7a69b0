"""The exit statuses of the sidecar's commands, each defined once (docs/commands.md#exit-statuses;
each command's `--help` ends with its own)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # `check`: a step failed
EXIT_NO_ANSWER = 1  # `status`, `stacks`: no sidecar answered
EXIT_CONFIG = 2  # every command: a configuration error, nothing started
EXIT_AMBIGUOUS = 2  # `status`, `stacks`: more than one sidecar could be meant
EXIT_CANNOT_LOOK = 3  # `stacks`: the sidecar answered but could not read the stacks
EXIT_CANNOT_START = 127  # `run`: the command could not be started (a shell's status)
EXIT_SIGNAL_BASE = 128  # `run`: the command died of signal N, status 128+N (a shell's convention)
