"""Command-line tools built on the library: checkpoint conversion, estimates, sweeps."""
