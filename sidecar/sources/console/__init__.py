"""The wrapped command's output (`sidecar run`): the child process, its pipes or pseudo-terminal
and signals (child.py), the bytes of each stream made into `/logs` text (lines.py, with the
terminal model of terminal.py for output that moves the cursor), and the failure signatures
matched on the same bytes (signatures.py). The wrapper (`sidecar/wrapper.py`) drives the pumps
and hands their text to the `/logs` shipper and the crash tail in `delivery/`; the signatures feed
the failure summary (`sidecar/diagnose.py`)."""
