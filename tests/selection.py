"""What the selected tests read: lets a module's shared multi-rank fixture skip work no selected test reads."""


def parity_only(request) -> bool:
    """Whether every test of this session that uses the calling fixture (directly or through another) is marked
    `parity`: true in `make test`'s portable pass (`-m parity`), where only the parity tests' numbers are read,
    so the fixture may run just the training those tests compare (the same runs, without the extra checks)."""
    users = [item for item in request.session.items if request.fixturename in getattr(item, "fixturenames", ())]
    return bool(users) and all(item.get_closest_marker("parity") for item in users)
