"""Operator commands other than run and watch, each loaded by `cli.py` only when it runs."""
