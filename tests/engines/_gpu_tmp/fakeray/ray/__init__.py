"""FAKE ray for a one-off GPU check of EmbeddedEngine in process (ray is not installed there)."""


def method(**_kw):
    return lambda f: f


def remote(*_a, **_kw):
    raise RuntimeError("fake ray: no actors here")
