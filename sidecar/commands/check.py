"""`sidecar check`: resolve the configuration as `run` would and probe the ingest from this node.

Steps, in order, each printed as soon as it is known: the platform's variables, the state dir,
DNS, where the address leads (a loopback endpoint inside a pod is the pod itself, the most common
cause of empty charts), TCP, TLS, and an authenticated harmless request: an empty `/logs` batch
posted by the running sidecar's own client (check_endpoint.py). A failure names the
likely cause and the fix. Exit 0 only when the probe was accepted (or reporting is off).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sidecar.commands.check_endpoint import check_endpoint, family_of
from sidecar.commands.check_report import CheckReport
from sidecar.config import Config, resolve, unknown_variables
from sidecar.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, ConfigError
from sidecar.masking import add_secret, mask
from sidecar.sources.base import Head
from sidecar.sources.files.discover import match
from sidecar.sources.files.kinds import FILE_KINDS

SHOWN_FILES = 3  # files named in a source's line; --json lists up to MAX_LISTED_FILES
MAX_LISTED_FILES = 100
HEAD_BYTES = 64 << 10  # of each file of a kind that probes heads, to tell whether it gives points


def check(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Run every step, print what each found; 0 when the probe was accepted or reporting is
    off, 2 for a configuration error, 1 for anything else."""
    timeout_s = args.timeout
    report = CheckReport(args.json, sys.stdout)
    cfg, mistaken = _configuration(args, environ, report)
    _variables(environ, report)
    # Past a mistake, what can still be looked at is: the sources, and the endpoint when its
    # variable is good (a missing token still lets DNS, TCP and TLS be tried).
    _sources(cfg, report)
    if args.command or cfg.python is not None:
        _python(cfg, args.command, environ, report)
    if cfg.platform.enabled:  # with reporting off nothing is said of a stall
        _stacks(report, cfg.time_window)
    code = EXIT_OK
    if cfg.platform.enabled and cfg.platform.endpoint:
        _state_dir(cfg, report)
        code = asyncio.run(check_endpoint(cfg, environ, report, timeout_s))
    if mistaken:
        code = EXIT_CONFIG
    elif code == EXIT_OK and report.failed:  # a source that would send nothing
        code = EXIT_FAILED
    report.finish(code, None if mistaken else cfg)
    return code


def _python(cfg: Config, command: list[str], environ: Mapping[str, str],
            report: CheckReport) -> None:
    """Which Python `run`'s environment snapshot would describe, and how it was found."""
    from sidecar.sources.telemetry.environment import which_python

    python, how = which_python(cfg.python, command, environ)
    if python is None:
        report.add("python", "warn", "the trainer's Python is not found (no Python program, "
                   "#! line or PATH entry outside the sidecar's own environment): the "
                   "environment snapshot lists no packages; --python names it")
        return
    shown = f" for {' '.join(command)}" if command else ""
    report.add("python", "ok", f"the environment snapshot describes {python} ({how}){shown}",
               python=str(python), found_by=how)


def _configuration(args: argparse.Namespace, environ: Mapping[str, str],
                   report: CheckReport) -> tuple[Config, bool]:
    """The configuration as `run` would resolve it, and whether it holds a mistake: each one a
    failed step of its own, worst first (the platform's variables, then the options); the
    Config then has each bad option at its default, for the steps that can still be taken."""
    problems: list[str] = []
    cfg = resolve(args, "check", environ, problems=problems)
    add_secret(cfg.token)
    for problem in problems:
        report.add("configuration", "fail", mask(problem))
    if problems:
        return cfg, True
    family = family_of(environ)
    name = f"{family.name} variables" if family else "platform variables"
    enabled = f"{family.enabled}={environ[family.enabled]}" if family else "ENABLED"
    if not cfg.platform.enabled:
        report.add("configuration", "ok", f"{name}, {enabled}: reporting is off; `sidecar run` "
                   "passes the output through and posts nothing, so there is nothing to probe",
                   family=family.name if family else None, enabled=False)
        return cfg, False
    token = f"--token-file {cfg.token_file}" if cfg.token_file else cfg.platform.token_variable
    both = " (both families set, and they agree)" if len(cfg.platform.token_headers) > 1 else ""
    report.add("configuration", "ok", f"{name}{both}, {enabled}: run {cfg.platform.run_id} at "
               f"{cfg.platform.endpoint}; token from {token}",
               family=family.name if family else None, enabled=True,
               run_id=cfg.platform.run_id, endpoint=cfg.platform.endpoint, token_from=token)
    return cfg, False


def _variables(environ: Mapping[str, str], report: CheckReport) -> None:
    """SIDECAR_* variables no option reads: a typo there is otherwise silently ignored."""
    unknown = unknown_variables(environ)
    if unknown:
        report.add("variables", "warn", "; ".join(unknown),
                   unknown=[warning.split()[0] for warning in unknown])


def _heads(head: Callable[[bytes], Head], files: Sequence[str]) -> list[tuple[str, Head]]:
    """What the head of each file gives, parsed as `watch` would."""
    heads = []
    for name in files[:MAX_LISTED_FILES]:
        try:
            with open(name, "rb") as fh:
                data = fh.read(HEAD_BYTES)
        except OSError as exc:
            heads.append((name, Head(0, 0, f"cannot be read ({exc.strerror})")))
            continue
        heads.append((name, head(data)))
    return heads


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _head_note(name: str, found: Head) -> str:
    """What is wrong in one file's head: its lines skipped and its NaN values, each with the
    first; "" when nothing is."""
    parts = []
    if found.problem:
        skipped = f"{_plural(found.skipped, 'line')} skipped, " if found.skipped else ""
        parts.append(f"{skipped}{found.problem}")
    if found.not_finite:
        parts.append(f"{_plural(found.not_finite, 'NaN or infinite value')} never sent, the "
                     f"first {found.first_not_finite}")
    return f"{name}: {'; '.join(parts)}" if parts else ""


def _head_step(step: str, head: Callable[[bytes], Head], what: str, pattern: str,
               files: list[str], report: CheckReport) -> None:
    """A pattern's files read at their head: fail when they hold lines and no point; each file
    with lines skipped or NaN values named, with the first of each."""
    heads = _heads(head, files)
    points = sum(found.points for _, found in heads)
    listed = ", ".join(files[:SHOWN_FILES]) + (
        f", and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else "")
    count = f"{len(files)} file{'s' if len(files) > 1 else ''} ({listed})"
    notes = [note for note in (_head_note(name, found) for name, found in heads) if note]
    details: dict[str, Any] = {
        "pattern": pattern, "files": files[:MAX_LISTED_FILES], "matched": len(files),
        "points": points,
        "problems": [{"file": name, "problem": found.problem}
                     for name, found in heads if found.problem],
        "heads": [{"file": name, "points": found.points, "skipped": found.skipped,
                   "not_finite": found.not_finite, "problem": found.problem,
                   "first_not_finite": found.first_not_finite} for name, found in heads]}
    said = "; ".join(notes[:SHOWN_FILES]) + (
        f"; and {len(notes) - SHOWN_FILES} more files" if len(notes) > SHOWN_FILES else "")
    their, them = ("its", "it") if len(files) == 1 else ("their", "them")
    if not points and any(found.problem for _, found in heads):
        report.add(step, "fail", f"{what}: {count}, and no point in {their} first lines: "
                   f"{said}", **details)
    elif not points and notes:
        report.add(step, "fail", f"{what}: {count}, and only NaN or infinite values in "
                   f"{their} first lines, which are never sent: {said}", **details)
    elif notes:
        report.add(step, "warn", f"{what}: {count}, {points} points in {their} first lines, "
                   f"but {said}", **details)
    elif not points:
        report.add(step, "warn", f"{what}: {count}, no complete line in {them} yet; points "
                   "are sent as the trainer writes them", **details)
    else:
        report.add(step, "ok", f"{what}: {count}, {points} points in {their} first lines",
                   **details)


def _sources(cfg: Config, report: CheckReport) -> None:
    """What each source option matches now, as `watch` would expand it."""
    given = [(kind, pattern) for kind in FILE_KINDS for pattern in cfg.files.get(kind.name, ())]
    for kind, pattern in given:
        names, note = match(pattern, kind.flag, kind.name, kind.tree)
        files = [p for p in names if os.path.isfile(p)]
        what = f"{kind.flag} {pattern}"
        if files and kind.head is not None:
            _head_step(kind.name, kind.head, what, pattern, files, report)
            continue
        if files and kind.survey is not None:
            found = kind.survey(cfg, files)
            report.add(kind.name, found.status, f"{what}: {found.message}", pattern=pattern,
                       **found.details)
            continue
        if files:
            more = f", and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else ""
            report.add(kind.name, "ok", f"{what}: {len(files)} file{'s' if len(files) > 1 else ''} "
                       f"({', '.join(files[:SHOWN_FILES])}{more})", pattern=pattern,
                       files=files[:MAX_LISTED_FILES], matched=len(files))
            continue
        hint = ("in a pod, check the volume's mountPath, the same in both containers"
                if "does not exist" in note else "files that appear later are followed, but "
                "check the name (and quote a pattern, so that the shell leaves it to the sidecar)")
        report.add(kind.name, "warn", f"{what}: {note or 'nothing matches yet'}; {hint}",
                   pattern=pattern, matched=0)
    for folder in cfg.checkpoints:
        _checkpoints(cfg, folder, report)
    if cfg.hparams is not None:
        _hparams(cfg.hparams, report)


def _stacks(report: CheckReport, time_window: int) -> None:
    """Whether stacks can be taken at a stall and each rank's time measured (--time-window,
    docs/time.md#where-it-cannot-look): py-spy is here, and may read a child of ours (`run`'s
    case) and a ranked process in view (`watch`'s); both read a process the same way."""
    without = ("a stall is said without the command's stacks" + (
        ", and where each rank's time goes (--time-window) is not measured" if time_window
        else ""))
    from sidecar.stacks import Process, dump, find_tool, ranked_processes

    tool = find_tool()
    if tool is None:
        report.add("stacks", "warn", f"py-spy is not installed: {without}; install the package "
                   "with its dependencies (docs/stalls.md#where-it-cannot-look)")
        return
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; print(flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert child.stdout is not None
        child.stdout.readline()
        probe = Process(child.pid, os.getpid(), "python")
        dump(tool, [probe], native=False, timeout_s=5.0)
    finally:
        child.kill()
        child.wait()
    if probe.error:
        report.add("stacks", "warn", f"py-spy cannot read even a child of ours ({probe.error}): "
                   f"{without}; a container needs CAP_SYS_PTRACE "
                   "(docs/stalls.md#where-it-cannot-look)", tool=tool)
        return
    ranked = [p for p in ranked_processes() if p.pid != os.getpid()][:1]
    if ranked:
        dump(tool, ranked, native=False, timeout_s=5.0)
        if ranked[0].error.startswith("refused"):
            report.add("stacks", "warn", f"`run`'s command can be read, but not PID "
                       f"{ranked[0].pid} (RANK {ranked[0].rank}), which `watch` would read: "
                       "ptrace is refused; give the sidecar CAP_SYS_PTRACE "
                       "(deploy/kubernetes/overlays/stacks)", tool=tool)
            return
    shares = (f", and each rank's time measured every {time_window} s (--time-window)"
              if time_window else "; --time-window 0: each rank's time is not measured")
    report.add("stacks", "ok", f"stacks can be taken at a stall{shares} ({tool})", tool=tool)


def _hparams(path: Path, report: CheckReport) -> None:
    """The --hparams file as `run` would read it: one the trainer writes later is waited for,
    one that cannot be read is never sent (the run goes on either way)."""
    from sidecar.sources.files.hparams import load_hparams

    if not path.exists():
        report.add("hparams", "warn", f"--hparams {path} does not exist yet; it is sent once "
                   "the trainer writes it (check the path if it never does)", path=str(path))
        return
    try:
        params = load_hparams(path)
    except ConfigError as exc:
        report.add("hparams", "fail", f"{exc}: nothing of it would be sent", path=str(path))
        return
    report.add("hparams", "ok", f"--hparams {path}: {len(params)} parameters",
               path=str(path), parameters=len(params))


def _state_dir(cfg: Config, report: CheckReport) -> None:
    """Whether the run's state folder can be created and written, without creating it."""
    existing = cfg.run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        report.add("state", "ok", f"{cfg.run_dir} is writable", path=str(cfg.run_dir))
        return
    if cfg.state_dir_is_default:
        report.add("state", "warn", f"{cfg.run_dir} cannot be written ({existing} is not a "
                   "writable folder): `run` keeps its state in a private folder under the "
                   "temporary directory instead, which a reboot may clear; pass --state-dir "
                   "(SIDECAR_STATE_DIR) a lasting writable folder", path=str(cfg.run_dir))
        return
    report.add("state", "fail", f"{cfg.run_dir} cannot be written ({existing} is not a writable "
               "folder): the spool and the lifecycle journal live there; pass --state-dir "
               "(SIDECAR_STATE_DIR) a writable folder, in a pod an emptyDir volume",
               path=str(cfg.run_dir))


def _checkpoints(cfg: Config, folder: str, report: CheckReport) -> None:
    """What one --checkpoints folder holds now, by writer, complete or not, and whether its
    paths would be posted (in a container, only those --artifact-uri maps)."""
    from collections import Counter

    from sidecar.options import parse_artifact_uri
    from sidecar.sources.files.checkpoints import (
        ArtifactPaths,
        checkpoints_in,
        container_signal,
        uploads_unmapped,
    )

    what = f"--checkpoints {folder}"
    if not os.path.isdir(folder):
        note = "is not a folder" if os.path.exists(folder) else "does not exist yet"
        report.add("checkpoints", "warn", f"{what}: {note}; checkpoints written there later "
                   "are found, but check the path (in a pod, the volume's mountPath)",
                   folder=folder, matched=0)
        return
    found, aliases = checkpoints_in(os.path.abspath(folder))
    container = container_signal(os.environ)
    upload = uploads_unmapped(cfg.checkpoint_upload, container)
    paths = ArtifactPaths([parse_artifact_uri(m) for m in cfg.artifact_uri], container,
                          upload=upload)
    formats = Counter(f"{c.shape.format} ({c.shape.kind})" for c in found)
    waiting = [f"{os.path.relpath(c.path, folder)}: {c.assessment.why}" for c in found
               if not c.assessment.complete]
    summary = (", ".join(f"{n} {name}" for name, n in sorted(formats.items())) or
               "no checkpoint yet")
    complete = len(found) - len(waiting)
    message = (f"{what}: {summary}; {complete} complete"
               + (f", {len(waiting)} not complete ({'; '.join(waiting[:SHOWN_FILES])})"
                  if waiting else "")
               + (f"; {aliases} aliases (last.ckpt, links) passed over" if aliases else ""))
    status = "ok"
    posted = paths.resolve(os.path.abspath(folder))
    if posted is None and upload:
        message += (f"; uploaded through the ingest's signed URLs (--checkpoint-upload "
                    f"{cfg.checkpoint_upload}{', in a container' if container else ''}), "
                    "then posted as the object-store URI it answers")
    elif posted is None:
        status = "warn"
        message += (f"; NOT POSTED: this runs in a container ({paths.container}), where a local "
                    "path is useless to the platform: give --artifact-uri LOCAL=URI naming "
                    "the object-store URI this folder mirrors, or let it be uploaded "
                    "(--checkpoint-upload auto)")
    elif posted != os.path.abspath(folder):
        message += f"; posted as {posted}/..."
    report.add("checkpoints", status, message, folder=folder, matched=len(found),
               complete=complete, waiting=waiting, aliases=aliases, posted_as=posted)


def main(args: argparse.Namespace) -> int:
    """`sidecar check`."""
    from sidecar.log import setup

    setup()  # unknown variables are one of its steps, not a line on stderr
    return check(args, os.environ)
