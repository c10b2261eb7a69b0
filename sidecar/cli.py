"""Commands and options -> Config -> run / watch / check / status / lifecycle / replay (CONTRACT 2).

Each command's module is imported when that command runs, so a daemon never carries the code of
the commands it is not running."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sidecar import __version__
from sidecar.config import ConfigError, add_options, command_of, option_help, resolve
from sidecar.delivery.lifecycle import EVENTS, Lifecycle
from sidecar.log import add_secret, log, setup

EXIT_CONFIG = 2
CHECK_TIMEOUT_S = 10.0  # how long each step of `sidecar check` may take


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sidecar", description="Forward a training job's output, metrics, telemetry and "
        "lifecycle to the platform's ingest API.")
    parser.add_argument("--version", action="version", version=f"sidecar {__version__}")
    commands = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="wrap a training command and report it",
                              usage="sidecar run [OPTIONS] -- COMMAND [ARG...]")
    add_options(run, "run")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")

    watch = commands.add_parser("watch", help="follow log, JSONL and TensorBoard files until "
                                "SIGTERM", usage="sidecar watch [OPTIONS]")
    add_options(watch, "watch")

    check = commands.add_parser("check", help="validate the configuration, probe the endpoint "
                                "from this node, explain what is wrong")
    check.add_argument("--json", action="store_true", help="print one JSON document")
    check.add_argument("--timeout", type=_seconds, default=CHECK_TIMEOUT_S, metavar="SECONDS",
                       help=f"how long each step may take (default {CHECK_TIMEOUT_S:g})")
    for name in ("token-file", "ca-file", "state-dir"):
        check.add_argument("--" + name, default=None, metavar=name.split("-")[-1].upper(),
                           help=option_help(name))
    check.add_argument("--config", default=None, metavar="FILE", help="TOML file with options")

    status = commands.add_parser("status", help="counters of the running daemon")
    status.add_argument("--status-addr", default=None, metavar="ADDR",
                        help="the daemon's status endpoint HOST:PORT (default: the address it "
                        "wrote to the state dir, else 127.0.0.1:9620)")
    status.add_argument("--once", action="store_true",
                        help="print the table once and exit (for scripts)")
    status.add_argument("--state-dir", default=None, metavar="DIR", help=option_help("state-dir"))
    status.add_argument("--config", default=None, metavar="FILE", help="TOML file with options")

    lifecycle = commands.add_parser("lifecycle", help="post one lifecycle event, strictly")
    lifecycle.add_argument("event", choices=EVENTS)
    lifecycle.add_argument("--state-dir", default=None, help="where the event is journaled")
    lifecycle.add_argument("--token-file", default=None, help="read the token from this file")
    lifecycle.add_argument("--config", default=None, metavar="FILE", help="TOML options file")
    lifecycle.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                           help="give up (exit 1, event kept for replay) after this long")

    replay = commands.add_parser("replay", help="deliver what an earlier run left spooled")
    replay.add_argument("--state-dir", default=None, help="the state dir the run used")
    replay.add_argument("--token-file", default=None, help="read the token from this file")
    replay.add_argument("--config", default=None, metavar="FILE", help="TOML options file")
    replay.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="give up (exit 1, data kept) after this long")

    receive = commands.add_parser("receive", help="a local ingest server that checks the "
                                  "contract and stores what it accepts")
    receive.add_argument("--host", default="127.0.0.1")
    receive.add_argument("--port", type=int, default=8080)
    receive.add_argument("--dir", type=Path, default=Path("received"),
                         help="folder for one JSONL file per route")
    receive.add_argument("--token", default=None, help="accept only this token (default: any)")
    receive.add_argument("--run-id", default=None, help="accept only this run id (default: any)")
    receive.add_argument("--ready-file", type=Path, default=None,
                         help="write the base URL here once listening")
    receive.add_argument("--faults", action="store_true",
                         help="test only: enable the fault-injection control route")
    receive.add_argument("--quiet", action="store_true", help="no live summary")

    commands.add_parser("demo", help="run a bundled example trainer against a local receiver")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = COMMANDS[args.cmd](args)
    except ConfigError as exc:
        print(f"sidecar {args.cmd}: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return code


def _run(args: argparse.Namespace) -> int:
    command = command_of(args.command)
    if not command:
        raise ConfigError("no command to run: put it after --, as in "
                          "`sidecar run -- ./train.sh`")
    cfg = resolve(args, "run", os.environ)
    setup(cfg.log_level, cfg.message_format)
    add_secret(cfg.token)
    from sidecar.daemon import run_wrapped

    return asyncio.run(run_wrapped(cfg, command, os.environ))


def _watch(args: argparse.Namespace) -> int:
    cfg = resolve(args, "watch", os.environ)
    setup(cfg.log_level, cfg.message_format)
    add_secret(cfg.token)
    if not (cfg.log or cfg.jsonl or cfg.tensorboard or cfg.hparams or cfg.hardware_interval):
        raise ConfigError("nothing to watch: give at least one of --log, --jsonl, "
                          "--tensorboard or --hparams, or leave --hardware-interval above 0")
    from sidecar.daemon import run_watch

    return asyncio.run(run_watch(cfg, os.environ))


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _check(args: argparse.Namespace) -> int:
    from sidecar.commands.check import check

    setup()
    return check(args, os.environ)


def _status(args: argparse.Namespace) -> int:
    from sidecar.commands.status import status_command

    return status_command(args)


def _lifecycle(args: argparse.Namespace) -> int:
    from sidecar.delivery import handoff

    setup()
    address = os.environ.get(handoff.ENV_VAR)
    if address:
        refusal = asyncio.run(handoff.hand_over(address, args.event))
        if refusal:
            log.error("lifecycle %s: %s", args.event, refusal)
            return 1
        return 0
    cfg = resolve(args, "lifecycle", os.environ)
    add_secret(cfg.token)
    if not cfg.platform.enabled:
        log.info("lifecycle %s: reporting is off (ENABLED=0), nothing posted", args.event)
        return 0
    return asyncio.run(_post_lifecycle(cfg, args.event, args.timeout))


async def _post_lifecycle(cfg: object, event: str, timeout_s: float) -> int:
    from sidecar.config import Config
    from sidecar.daemon import make_client

    assert isinstance(cfg, Config)
    client = make_client(cfg)
    assert client is not None
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    await client.start()
    lifecycle = Lifecycle(cfg.run_dir, cfg.platform.run_id, client)
    try:
        await lifecycle.open()
        await lifecycle.record(event, time.time())
        if await lifecycle.drain(timeout_s):
            return 1 if lifecycle.rejected else 0
        log.error("lifecycle %s: not acknowledged within %.0f s (%s); kept in %s for the next "
                  "start or `sidecar replay`", event, timeout_s,
                  client.route_stats("lifecycle").last_failure, cfg.run_dir)
        return 1
    finally:
        await lifecycle.close()
        await client.close()


def _replay(args: argparse.Namespace) -> int:
    cfg = resolve(args, "replay", os.environ)
    setup(cfg.log_level, cfg.message_format)
    add_secret(cfg.token)
    from sidecar.commands.replay import replay

    return asyncio.run(replay(cfg, args.timeout))


def _receive(args: argparse.Namespace) -> int:
    from sidecar.commands.receive import serve

    return serve(args.dir, host=args.host, port=args.port, token=args.token,
                 run_id=args.run_id, faults_enabled=args.faults, summary=not args.quiet,
                 ready_file=args.ready_file)


def _demo(args: argparse.Namespace) -> int:
    import tempfile

    from sidecar.commands.demo import demo

    with tempfile.TemporaryDirectory(prefix="sidecar-demo-") as tmp:
        return demo(Path(tmp))


COMMANDS = {"run": _run, "watch": _watch, "check": _check, "status": _status,
            "lifecycle": _lifecycle, "replay": _replay, "receive": _receive, "demo": _demo}
