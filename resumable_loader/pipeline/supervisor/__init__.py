"""The supervisor: it starts, watches, replaces and stops the worker processes."""
