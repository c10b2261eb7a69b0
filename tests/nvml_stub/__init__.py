"""A stand-in libnvidia-ml.so.1 built from C for the tests, and the harness that drives it."""
