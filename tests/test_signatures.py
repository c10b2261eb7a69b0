"""The failure-signature table, row by row, on real lines, and the scanner's block handling.

Where each line comes from:
- CUDA OOM: c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch), TORCH_CHECK_WITH(OutOfMemoryError,
  ..., "CUDA out of memory. Tried to allocate ", ..., ". GPU ", ..., " has a total capacity of ",
  ...), raised in Python as torch.OutOfMemoryError; the older RuntimeError form is from PyTorch
  1.x logs quoted in pytorch issues.
- NCCL watchdog: torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (pytorch/pytorch), the
  watchdog's c10::str("[Rank ", rank_, "] ", "Watchdog caught collective operation timeout: ",
  work, " ran for ", ..., " milliseconds before timing out."), as a real 2.x run logs it with
  the glog prefix; and WorkNCCL::handleException's "Some NCCL operations have failed or timed
  out..." line.
- NCCL errors: ProcessGroupNCCL's "NCCL error: unhandled system error, NCCL version 2.10.3" as
  a what() after std::terminate, and C10D_NCCL_CHECK's "NCCL error in: <file>:<line>, <reason>
  ..., NCCL version ..." (torch/csrc/distributed/c10d/NCCLUtils.hpp) raised as DistBackendError;
  NCCL's WARN macro (NVIDIA/nccl src/include/debug.h) prints "host:pid:tid [dev] NCCL WARN ...",
  here the "Cuda failure" of src/include/checks.h.
- CUDA errors: cudaGetErrorString texts of cudaErrorIllegalAddress ("an illegal memory access was
  encountered") and cudaErrorAssert ("device-side assert triggered") from the CUDA Runtime API
  reference, as c10/cuda/CUDAException.cpp prefixes them ("CUDA error: ").
- No space left: strerror(ENOSPC), as Python's OSError prints it.
- Traceback and exception lines: CPython's traceback module (Lib/traceback.py).
"""

from __future__ import annotations

import pytest

from sidecar.sources.console.signatures import SIGNATURES, Scanner

OOM_LINE = (b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
            b"a total capacity of 79.10 GiB of which 1.06 GiB is free. Including non-PyTorch "
            b"memory, this process has 78.03 GiB memory in use. Of the allocated memory 75.21 "
            b"GiB is allocated by PyTorch, and 1.29 GiB is reserved by PyTorch but unallocated.")
WATCHDOG_LINE = (b"[rank0]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog "
                 b"caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, "
                 b"NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) ran for 600081 "
                 b"milliseconds before timing out.")

ROWS = [
    ("cuda_oom", OOM_LINE),
    ("cuda_oom", b"RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 "
                 b"GiB total capacity; 130.35 MiB already allocated; 47.06 MiB free)"),
    ("cuda_oom", b"RuntimeError: CUDA error: out of memory"),
    ("nccl_watchdog_timeout", WATCHDOG_LINE),
    ("cuda_error", b"torch.AcceleratorError: CUDA error: an illegal memory access was "
                   b"encountered"),
    ("cuda_error", b"RuntimeError: CUDA error: device-side assert triggered"),
    ("nccl_error", b"  what():  NCCL error: unhandled system error, NCCL version 2.10.3"),
    ("nccl_error", b"torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/"
                   b"distributed/c10d/NCCLUtils.hpp:219, unhandled system error (run with "
                   b"NCCL_DEBUG=INFO for details), NCCL version 2.19.3"),
    ("nccl_warn", b"gpu-node-07:4187:4251 [3] NCCL WARN Cuda failure 'out of memory'"),
    ("disk_full", b"OSError: [Errno 28] No space left on device"),
    ("python_traceback", b"Traceback (most recent call last):"),
]


@pytest.mark.parametrize(("name", "line"), ROWS)
def test_each_row_matches_its_real_line(name: str, line: bytes) -> None:
    scanner = Scanner()
    scanner.feed("stderr", line + b"\n")
    assert scanner.counts[name] == 1
    assert scanner.seen[name].line == line.decode().strip()[:160].rstrip() + (
        " ..." if len(line.strip()) > 160 else "")


def test_every_row_of_the_table_is_exercised() -> None:
    covered = {name for name, _ in ROWS} | {"python_exception"}
    assert covered == {row.name for row in SIGNATURES}


def test_no_row_matches_ordinary_training_output() -> None:
    scanner = Scanner()
    scanner.feed("stdout", b"step 100 loss 0.4132 lr 3e-4 grad_norm 1.2 tokens/s 181234\n"
                 b"NCCL INFO Channel 00/32 : 0 1 2 3 4 5 6 7\n"
                 b"Using CUDA device 0: NVIDIA H100 80GB HBM3\n"
                 b"ValueError: printed by a logger, with no traceback before it\n")
    assert sum(scanner.counts.values()) == 0


TRACEBACK = (b"Traceback (most recent call last):\n"
             b'  File "/work/train.py", line 41, in <module>\n'
             b"    main()\n"
             b'  File "/work/train.py", line 12, in main\n'
             b'    raise ValueError("learning rate must be positive, got -0.1")\n'
             b"ValueError: learning rate must be positive, got -0.1\n")


def test_the_exception_line_after_a_traceback() -> None:
    scanner = Scanner()
    scanner.feed("stderr", TRACEBACK)
    seen = scanner.seen["python_exception"]
    assert (seen.line, seen.groups["exception"]) == (
        "ValueError: learning rate must be positive, got -0.1", "ValueError")


def test_a_chained_traceback_quotes_its_last_exception() -> None:
    scanner = Scanner()
    scanner.feed("stderr", TRACEBACK + b"\nDuring handling of the above exception, another "
                 b"exception occurred:\n\n" + TRACEBACK.replace(b"ValueError: learning",
                                                             b"KeyError: learning"))
    assert scanner.seen["python_exception"].groups["exception"] == "KeyError"
    assert scanner.counts["python_traceback"] == 2


@pytest.mark.parametrize("cut", range(1, len(OOM_LINE), 7))
def test_a_line_cut_across_blocks_counts_once(cut: int) -> None:
    scanner = Scanner()
    data = b"x" * 50 + b"\n" + OOM_LINE + b"\n" + b"y" * 10 + b"\n"
    scanner.feed("stderr", data[:cut + 51])
    scanner.feed("stderr", data[cut + 51:])
    assert scanner.counts["cuda_oom"] == 1
    assert scanner.seen["cuda_oom"].line.startswith("torch.OutOfMemoryError: CUDA out of")


def test_a_line_cut_byte_by_byte_counts_once() -> None:
    scanner = Scanner()
    for i in range(len(TRACEBACK)):
        scanner.feed("stderr", TRACEBACK[i:i + 1])
    assert scanner.counts["python_traceback"] == 1
    assert scanner.counts["python_exception"] == 1


def test_an_unfinished_last_line_counts_when_the_stream_ends() -> None:
    scanner = Scanner()
    scanner.feed("stderr", WATCHDOG_LINE)
    assert scanner.counts["nccl_watchdog_timeout"] == 0
    scanner.finish("stderr")
    assert scanner.counts["nccl_watchdog_timeout"] == 1


def test_streams_are_kept_apart() -> None:
    scanner = Scanner()
    scanner.feed("stdout", b"Traceback (most recent call last):\n")
    scanner.feed("stderr", b"ValueError: on the other stream\n")
    assert scanner.counts["python_exception"] == 0
    scanner.feed("stdout", b"last words\n\n")
    assert scanner.last_line("stdout") == "last words"
    assert scanner.last_line("stderr") == "ValueError: on the other stream"


def test_every_stream_is_searched_for_everything() -> None:
    """Tracebacks, glog and CUDA messages go to stderr, NCCL's WARN lines to stdout, but `exec
    2>&1`, `| tee` and `| cat` put everything on stdout; under --tty both streams are one."""
    lines = OOM_LINE + b"\n" + WATCHDOG_LINE + b"\ngpu-node-07:4187:4251 [3] NCCL WARN x\n"
    for stream in ("stdout", "stderr", "terminal"):
        scanner = Scanner()
        scanner.feed(stream, lines)
        assert {name for name, count in scanner.counts.items() if count} == {
            "cuda_oom", "nccl_watchdog_timeout", "nccl_warn"}
        assert scanner.seen["cuda_oom"].stream == stream
