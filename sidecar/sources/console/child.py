"""The wrapped command: spawn, pipes, signals, exit status (docs/commands.md#the-wrapped-command).

The child runs in its own process group with stdout and stderr on two pipes, on one pipe (where
the sidecar's own stdout and stderr are one destination: two pipes would lose the order they
were written in, docs/running.md#the-commands-output), or on one pseudo-terminal (`--tty`).
When the sidecar's stdin is the terminal it runs in the foreground of, the child's group gets
the terminal's foreground for as long as it runs, as a shell gives it to a job, so that it can
read its input (input(), pdb) and Ctrl-C reaches it. Each pipe has a pump thread that copies the
bytes to the sidecar's own stdout/stderr unchanged (as `tee` would) and then offers them to the
event loop. The offer never waits: if the loop falls behind by more than a bounded amount, the
block is dropped for `/logs` (and counted), so the child can only ever be slowed by the
sidecar's own stdout, exactly as under `tee`. A block that `/logs` does not want at all
(reporting off, its buffer full, `--log-rate` spent) goes from the pipe to the sidecar's own
output with splice(2), in the kernel, without entering Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from sidecar.exits import EXIT_SIGNAL_BASE
from sidecar.log import log, open_line
from sidecar.supervise import SUPERVISOR

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
PIPE_BYTES = 1 << 20  # a larger pipe means fewer, larger reads
# the whole pipe at once: reads of 960 KiB (records.LOG_BLOCK) slowed a flooding child from 0.6x to
# 1.0x of `| tee` (bench_wrapper), and /logs cuts a block anyway
READ_BYTES = PIPE_BYTES
FORWARDING_FAILED = "forwarding this stream to /logs failed (said once)"
MAX_PENDING_BYTES = 32 << 20  # output offered to the loop but not yet taken
SMALL_READ_BYTES = 16 << 10  # a read this small, right after another, waits for company:
# a flood of small writes (a bar's redraws, a line each 10 ms) is read 10 times a second at most,
# not once per write (each read wakes the event loop: at 0.02 s a trickle of 100 lines/s cost `run`
# 1.8x the CPU); a lone line is never delayed
COALESCE_S = 0.1
# ... but never so long that the pipe could fill meanwhile: a writer blocks only on a full pipe,
# so a pause ends before this share of it could fill at the rate the command last wrote (a fast
# printer's pause shrinks to milliseconds, a trickle's stays COALESCE_S)
PAUSE_FILL_SHARE = 0.25
# what a pseudo-terminal holds before its writer blocks (the kernel's flip buffers: about 64 KiB)
TERMINAL_BUFFER_BYTES = 64 << 10
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
DEFAULT_WINDOW = (24, 80)  # rows, columns of --tty's terminal when the sidecar has none


class ReadOrder:
    """The order in which the command's streams had output waiting, kept in the order in which
    their blocks reach the loop: `/logs` chunks carry no stream or time, so their order is all
    the console has. A pump pausing to let more output gather (COALESCE_S) stops as soon as
    another stream has output, so that what it reads was written before that: woken by the
    kernel when the other pipe becomes readable (the other pump need not have run yet), or by
    that pump once it knows. And a pump offers what it read only once no other stream holds
    output that waited longer (at most `max_wait_s`: a pump stuck writing to a blocked sink
    holds nobody up for long)."""

    def __init__(self, max_wait_s: float = 2 * COALESCE_S) -> None:
        self.max_wait_s = max_wait_s
        self._changed = threading.Condition()
        self._waiting: dict[str, float] = {}  # stream: since when its pump knows output waits
        self._sources: dict[str, int] = {}  # stream: the pipe its pump reads, while it is open
        self._nudges: dict[str, int] = {}  # stream: an eventfd that ends its pump's pause

    def watch(self, name: str, source_fd: int) -> None:
        with self._changed:
            self._sources[name] = source_fd
            self._nudges[name] = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def unwatch(self, name: str) -> None:
        """The pump is about to close its pipe: nobody polls that descriptor any more."""
        with self._changed:
            self._sources.pop(name, None)
            nudge = self._nudges.pop(name, None)
        if nudge is not None:
            os.close(nudge)

    def ready(self, name: str) -> None:
        """In a pump: output waits on `name` (poll said so), read or not yet."""
        with self._changed:
            if name in self._waiting:
                return
            self._waiting[name] = time.monotonic()
            self._changed.notify_all()
            for stream, nudge in self._nudges.items():
                if stream != name:
                    os.eventfd_write(nudge, 1)

    def pause(self, name: str, wait_s: float) -> None:
        """In a pump, to let more of `name`'s output gather: `wait_s` at most, and not at all
        while another stream has output waiting (it must not overtake what waits here)."""
        wake = select.poll()
        with self._changed:
            nudge = self._nudges.get(name)
            if nudge is None:
                return
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(nudge)  # nudges from before: what they said is in _waiting
            if any(stream != name for stream in self._waiting):
                return
            wake.register(nudge, select.POLLIN)
            for stream, fd in self._sources.items():
                if stream != name:
                    wake.register(fd, select.POLLIN)
        wake.poll(wait_s * 1000)

    def turn(self, name: str) -> None:
        """In a pump, before it offers what it read: until no other stream holds output that
        waited longer (or `max_wait_s` passed: a pump stuck writing to a blocked sink)."""
        with self._changed:
            since = self._waiting.get(name, float("inf"))
            self._changed.wait_for(
                lambda: all(other >= since for stream, other in self._waiting.items()
                            if stream != name), self.max_wait_s)

    def done(self, name: str) -> None:
        """In a pump: what it read is offered (or skipped); nothing of `name` waits any more."""
        with self._changed:
            if self._waiting.pop(name, None) is not None:
                self._changed.notify_all()


class SpawnError(Exception):
    """The command could not be started (not found, not executable)."""


class Gate(Protocol):
    """How much of a stream `/logs` wants next; asked from the pump thread."""

    def allowance(self) -> tuple[int, str]:
        """The bytes `/logs` would take now, or 0 and why not (what waits is then skipped)."""

    def taken(self, size: int) -> None:
        """A wanted block of `size` bytes was read (charged to the rate budget)."""


class Pump:
    """Copies one pipe to an output fd in a thread and offers the blocks `gate` wants to the
    event loop; the others it moves with splice(2) and reports as skipped."""

    def __init__(self, name: str, source_fd: int, sink_fd: int, gate: Gate,
                 on_block: Callable[[bytes], None], on_skip: Callable[[int, str], None],
                 on_eof: Callable[[], None], loop: asyncio.AbstractEventLoop,
                 order: ReadOrder | None = None,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        """`on_block`, on the loop: a block to forward; `on_skip`, on the loop: bytes not
        forwarded, and why."""
        self.name = name
        self.source_fd = source_fd
        self.sink_fd = sink_fd
        self.gate = gate
        self.on_block = on_block
        self.on_skip = on_skip
        self.on_eof = on_eof
        self.loop = loop
        self.order = ReadOrder() if order is None else order  # shared by a command's pumps
        self.order.watch(name, source_fd)
        self.max_pending_bytes = max_pending_bytes
        self.dropped_bytes = 0  # offered while the loop was too far behind
        self._pending = 0
        self._lock = threading.Lock()
        self._sink_open = True
        self._can_splice = True  # until splice(2) says this sink cannot take it
        self._forwarding_failed = False  # the /logs side raised: pass through only from then on
        # the sink is where our own messages go (our stderr): what passes through is seen, so that
        # ours never glue onto it
        self._beside_ours = False
        self._small_read_at = float("-inf")  # when the last read was a small one
        self._capacity_bytes = _buffer_bytes(source_fd)  # what the pipe holds before a write waits
        # the command's output rate, measured from one pause to the next: what bounds the next
        self._rate_bps = 0.0
        self._cycle_started = time.monotonic()
        self._cycle_bytes = 0
        self._cycle_filled = False  # a read of the cycle found the pipe full: the writer waited

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=f"pump-{self.name}", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        self._beside_ours = open_line.shares_our_stderr(self.sink_fd)
        if self._beside_ours:
            self._can_splice = False  # splice(2) would hide whether a line was left open
        ready = select.poll()
        ready.register(self.source_fd, select.POLLIN)
        try:
            while True:
                ready.poll()  # decide once output waits, not before: a wait may be long
                self.order.ready(self.name)
                self._coalesce()
                wanted, why = self._allowance()
                if wanted:
                    block = self._copy(min(wanted, READ_BYTES))
                    if not block:
                        break
                    self._read(len(block))
                    self.order.turn(self.name)
                    self._forward(block)
                    self.order.done(self.name)
                    continue
                moved = self._splice()
                if moved is None:
                    moved = len(self._copy(READ_BYTES))
                self._read(moved)
                if not moved:
                    break
                self.loop.call_soon_threadsafe(self.on_skip, moved, why)
                self.order.done(self.name)
        except OSError as exc:
            if exc.errno != errno.EIO:  # EIO: a terminal whose last writer closed it, the end
                log.warning("reading the command's %s failed: %s", self.name, exc)
        finally:
            self.order.unwatch(self.name)
            self.order.done(self.name)
            os.close(self.source_fd)
            self.loop.call_soon_threadsafe(self.on_eof)

    def _allowance(self) -> tuple[int, str]:
        """What the gate grants; nothing more once forwarding failed (`_forward`)."""
        if self._forwarding_failed:
            return 0, FORWARDING_FAILED
        try:
            return self.gate.allowance()
        except Exception as exc:
            self._forwarding_broke(exc)
            return 0, FORWARDING_FAILED

    def _forward(self, block: bytes) -> None:
        """Hand a block (already passed through) on to /logs. A bug on that side is said and
        counted once, and the rest of the stream only passes through: the command's pipe is
        never closed early, which would kill it with SIGPIPE at its next write."""
        try:
            self.gate.taken(len(block))
            self._offer(block)
        except Exception as exc:
            self._forwarding_broke(exc)

    def _forwarding_broke(self, exc: Exception) -> None:
        self._forwarding_failed = True
        SUPERVISOR.failed(f"pump-{self.name}", exc, "the output still passes through; the rest "
                          "of it is not forwarded to /logs")

    def _coalesce(self) -> None:
        """Right after a small read, let more output gather before the next one, for as long as
        the pipe cannot fill meanwhile."""
        now = time.monotonic()
        wait = self._small_read_at + COALESCE_S - now
        if wait <= 0:
            return
        self._measure_rate(now)
        if self._rate_bps > 0:
            wait = min(wait, PAUSE_FILL_SHARE * self._capacity_bytes / self._rate_bps)
        self.order.pause(self.name, wait)

    def _measure_rate(self, now: float) -> None:
        """The rate of the cycle that ends (from the last pause to this one). It rises at once
        and falls by half a cycle at most, so that one quiet moment of a fast printer does not
        bring back the long pause; a cycle that found the pipe full measured only what the pipe
        let through, so the rate is at least doubled."""
        elapsed = now - self._cycle_started
        if elapsed <= 0:
            return
        measured = self._cycle_bytes / elapsed
        if self._cycle_filled:
            measured = max(measured, self._rate_bps) * 2
        self._rate_bps = max(measured, self._rate_bps / 2)
        self._cycle_started, self._cycle_bytes, self._cycle_filled = now, 0, False

    def _read(self, size: int) -> None:
        self._small_read_at = time.monotonic() if size < SMALL_READ_BYTES else float("-inf")
        self._cycle_bytes += size
        if size >= self._capacity_bytes:
            self._cycle_filled = True

    def _splice(self) -> int | None:
        """Move what waits in the pipe to the sink in the kernel; None when it must be read
        instead (the sink cannot take splice(2), a terminal for one, or it is gone)."""
        if not (self._can_splice and self._sink_open):
            return None
        try:
            return os.splice(self.source_fd, self.sink_fd, READ_BYTES)
        except OSError as exc:
            if exc.errno == errno.EIO and os.isatty(self.source_fd):
                return 0  # --tty: the child's terminal closed by its last writer, the end
            if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EBADF):
                self._can_splice = False
            else:
                self._sink_gone(exc)
            return None

    def _copy(self, size: int) -> bytes:
        """Read up to `size` bytes and pass them through to the sink."""
        block = os.read(self.source_fd, size)
        self._pass_through(block)
        return block

    def _pass_through(self, block: bytes) -> None:
        if not self._sink_open:
            return
        view = memoryview(block)
        try:
            while view:
                view = view[os.write(self.sink_fd, view):]
        except OSError as exc:
            self._sink_gone(exc)
        if self._beside_ours:
            open_line.written(self.sink_fd, block)

    def _sink_gone(self, exc: OSError) -> None:
        """Our own stdout went away: keep forwarding to /logs."""
        self._sink_open = False
        log.warning("cannot write the command's %s to the sidecar's own (%s); it is still "
                    "forwarded to /logs", self.name, exc.strerror)

    def _offer(self, block: bytes) -> None:
        with self._lock:
            if self._pending + len(block) > self.max_pending_bytes:
                self.dropped_bytes += len(block)
                self.loop.call_soon_threadsafe(self.on_skip, len(block),
                                               "the sidecar fell behind the command's output")
                return
            self._pending += len(block)
        self.loop.call_soon_threadsafe(self._take, block)

    def _take(self, block: bytes) -> None:
        """On the loop: hand the block on."""
        with self._lock:
            self._pending -= len(block)
        self.on_block(block)


class Child:
    """A spawned command, its exit status, and signal forwarding to its process group."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], tty: bool = False,
                 one_pipe: bool = False) -> None:
        """`tty`: stdout and stderr on one pseudo-terminal instead of two pipes; `one_pipe`: on
        one pipe."""
        self.argv = argv
        self.env = env
        self.tty = tty
        self.one_pipe = one_pipe
        self.pid = 0
        self.reap_orphans = os.getpid() == 1
        self._proc: subprocess.Popen[bytes] | None = None
        self._exit: asyncio.Future[int] | None = None
        self._foreground: _Foreground | None = None
        self._output_links: set[str] = set()  # how /proc/PID/fd shows its output's write end
        self.exited_at: float | None = None  # time.time() when it exited, seen by a thread that
        self.exited_monotonic: float | None = None  # waits for it: the loop may be late to it

    def spawn(self) -> tuple[int, ...]:
        """Start the command; returns what to read its output from: the read ends of its stdout
        and stderr pipes, or the one pipe or pseudo-terminal both share."""
        loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        loop.add_signal_handler(signal.SIGCHLD, self._reap)
        terminal = _open_terminal() if self.tty else None
        output = terminal[1] if terminal is not None else subprocess.PIPE
        errors = output if terminal is not None or not self.one_pipe else subprocess.STDOUT
        if terminal is not None:
            self._output_links = {os.ttyname(terminal[1])}
        try:
            self._proc = subprocess.Popen(list(self.argv), stdout=output, stderr=errors,
                                          env=dict(self.env), process_group=0, close_fds=True)
        except OSError as exc:
            loop.remove_signal_handler(signal.SIGCHLD)
            raise SpawnError(f"cannot start {self.argv[0]!r}: {exc.strerror}") from None
        finally:
            if terminal is not None:
                os.close(terminal[1])  # the child holds it now: its exit ends the reads (EIO)
        self.pid = self._proc.pid
        self._foreground = _Foreground.give(self.pid)  # first: it may be reading its terminal
        threading.Thread(target=self._see_exit, args=(loop,), name="child-exit",
                         daemon=True).start()
        if terminal is not None:
            self._reap()
            return (terminal[0],)
        pipes = [pipe for pipe in (self._proc.stdout, self._proc.stderr) if pipe is not None]
        fds = tuple(os.dup(pipe.fileno()) for pipe in pipes)
        for pipe in pipes:  # the pumps own the duplicates and close them at EOF
            pipe.close()
        for fd in fds:
            _enlarge_pipe(fd)
        self._output_links = {f"pipe:[{os.fstat(fd).st_ino}]" for fd in fds}
        self._reap()  # it may have exited before the handler could see it
        return fds

    async def wait(self) -> int:
        """The exit status as a shell reports it: the code, or 128+N for death by signal N."""
        assert self._exit is not None
        return await self._exit

    @property
    def running(self) -> bool:
        """Spawned and not yet exited."""
        return self._exit is not None and not self._exit.done()

    def signal(self, signum: int) -> None:
        """Send `signum` to the child's whole process group."""
        if not self.running:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

    def output_holders(self) -> list[int]:
        """The processes other than this one that still hold the command's output open (a
        background process it left), as far as /proc shows them; blocking (many small reads)."""
        own = os.getpid()
        holders = []
        with contextlib.suppress(OSError), os.scandir("/proc") as entries:
            for entry in entries:
                if entry.name.isdigit() and int(entry.name) != own and self._holds(entry.path):
                    holders.append(int(entry.name))
        return sorted(holders)

    def _holds(self, process: str) -> bool:
        try:
            fds = os.listdir(f"{process}/fd")
        except OSError:  # gone, or not ours to look at
            return False
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"{process}/fd/{fd}") in self._output_links:
                    return True
        return False

    def _see_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        """In a thread: the moment the child exits, without reaping it (the loop does)."""
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except OSError:  # reaped already (the loop was there first): its clock stands
            return
        self.exited_monotonic, self.exited_at = time.monotonic(), time.time()
        with contextlib.suppress(RuntimeError):  # the loop closed
            loop.call_soon_threadsafe(self._reap)

    def _reap(self) -> None:
        """SIGCHLD: collect the child's status; as PID 1 also reap adopted orphans, as tini does."""
        target = -1 if self.reap_orphans else self.pid
        while True:
            try:
                pid, status = os.waitpid(target, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid:
                self._finish(status)
                if not self.reap_orphans:
                    return

    def _finish(self, status: int) -> None:
        if self._foreground is not None:
            self._foreground.take_back()
            self._foreground = None
        code = os.waitstatus_to_exitcode(status)
        code = EXIT_SIGNAL_BASE - code if code < 0 else code
        if self._proc is not None:
            self._proc.returncode = code  # so Popen never waits on a pid already reaped
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(code)
        if not self.reap_orphans:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)


def _buffer_bytes(fd: int) -> int:
    """What the pipe (or pseudo-terminal) behind `fd` holds before its writer waits."""
    try:
        return int(fcntl.fcntl(fd, _F_GETPIPE_SZ))
    except OSError:  # not a pipe: a pseudo-terminal
        return TERMINAL_BUFFER_BYTES


def _enlarge_pipe(fd: int) -> None:
    # capped by /proc/sys/fs/pipe-max-size: the default size still works
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)


class _Foreground:
    """The terminal's foreground, lent to the child's process group while it runs."""

    def __init__(self, fd: int, own_group: int) -> None:
        self.fd = fd
        self.own_group = own_group

    @classmethod
    def give(cls, child_group: int) -> _Foreground | None:
        """Lend the foreground of the terminal on our stdin to `child_group`, when we hold it."""
        try:
            if not os.isatty(0) or os.tcgetpgrp(0) != os.getpgrp():
                return None  # no terminal, or we run in the background: nothing to lend
            # In the background from now on: our own writes to the terminal must not stop us.
            signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            os.tcsetpgrp(0, child_group)
        except OSError:
            return None
        # It may have read its terminal before it was given it, and been stopped for that.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child_group, signal.SIGCONT)
        return cls(0, os.getpgrp())

    def take_back(self) -> None:
        """The child exited: the foreground comes back to us, as a shell takes it back."""
        with contextlib.suppress(OSError):
            os.tcsetpgrp(self.fd, self.own_group)
        signal.signal(signal.SIGTTOU, signal.SIG_DFL)


def _open_terminal() -> tuple[int, int]:
    """A pseudo-terminal (controller, then the child's end), as large as ours or 80x24, that
    passes the child's bytes unchanged (no output processing: \\n stays \\n)."""
    controller, child_end = os.openpty()
    rows, columns = DEFAULT_WINDOW
    for fd in (1, 2, 0):
        with contextlib.suppress(OSError):
            rows, columns = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, bytes(8)))[:2]
            if rows and columns:
                break
            rows, columns = DEFAULT_WINDOW
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    attributes = termios.tcgetattr(child_end)
    attributes[1] &= ~termios.OPOST
    termios.tcsetattr(child_end, termios.TCSANOW, attributes)
    os.set_inheritable(child_end, False)
    return controller, child_end
