"""Every change the kit makes to upstream code or to a process-wide setting, one module per upstream problem.

Each module's turn-on function is private and named in `compat.door.FEATURES`; `compat.apply(name)` is the only
caller (tests/test_layout.py). Each records a `compat.registry` row (upstream file:line, the version it was written
for, a still-needed canary in tests/compat/)."""
