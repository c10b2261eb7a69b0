"""GPUs through NVML: a typed wrapper over nvidia-ml-py, the per-device queries, XID events.

Every function here blocks: NVML is a C library, and a call can hang for good when a GPU falls
off the bus. The sampler (`telemetry/sampler.py`) runs them on its worker thread, never on the
event loop.

- bindings.py: the library and nvidia-ml-py loaded at first use, NVML's return codes and
  `NvmlError`, the calls by name (`call`) and straight through ctypes (`Function`)
- structs.py: members of NVML's structs read in one struct call, not through ctypes attributes
- devices.py: the job's GPUs opened (`discover`), each a `GpuDevice` running its queries
- queries.py: what a sample reads of a GPU, one `Query` a thing (`QUERIES`)
- memory.py, fields.py, processes.py: the reusable requests some queries share
- mig.py, gpm.py: MIG instances and their memory; GPM's interval averages (Hopper and newer)
- xid.py: the thread waiting on XID critical-error events
- info.py: the environment snapshot's NVIDIA part
"""
