"""Kernel families. Each family module holds a kernel class; `*_limits` modules hold the
pure-Python rules a configuration must satisfy, so the registry can validate YAML without
importing the DSL."""
