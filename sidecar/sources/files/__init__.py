"""Files followed as they grow: which files the patterns name (discover.py, and scan.py for a
look over every source), change events (inotify.py), the follower that reads them through
rotation and truncation (follow.py) with one followed file's state (tail.py), what makes a file
the same file (identity.py) and the descriptors files may hold (descriptors.py), one
parser per kind (logfile.py, jsonl.py, tensorboard.py with tensorboard_schema.py, and hparams.py
for `--hparams`), each kind registered once in kinds.py, and the per-file read offsets in
`offsets.json` (offsets.py), committed only once the ingest acknowledged every payload made from
the bytes before them. The pipeline (`sidecar/pipeline.py`) drives the follower and takes its
payloads to the batchers in `delivery/`."""
