"""Read-only accessors of megatron's, the bridge's and torch's internals: they read private attributes or call
private upstream functions, and change nothing that outlives the call (tests/test_layout.py: no module here
assigns an attribute of a module it imported, or imports a patch). A change is a patch: `compat/patches/`."""
