"""Where data enters, in three kinds, each a package of its own:

- `console/`: the wrapped command's own output (`sidecar run`): the child and its pipes or
  terminal, the line assembly that turns its bytes into `/logs` text, the terminal model for
  output that moves the cursor, and the failure signatures matched as the bytes pass.
- `files/`: files followed as they grow (`--log`, `--jsonl`, `--tensorboard`, `--hparams`):
  discovery, inotify, rotation, the parsers, and the per-file offsets committed once the ingest
  acknowledged what was read before them.
- `telemetry/`: what the node says about itself: hardware samples (NVML, /proc, sysfs), the
  memory cgroup's OOM kills and the environment snapshot.

`base.py` holds what the file parsers share with the pipeline that drives them. The kinds import
none of each other, with one exception that tests/test_layout.py names: a followed log file is a
console captured to disk, so `files/logfile.py` assembles its lines with `console/lines.py`, and
a file and the command's own output are masked and cut alike. What a source produces goes to the
pipeline (`sidecar/pipeline.py`, `sidecar/wrapper.py`) and from there to `delivery/`, which no
source imports.
"""
