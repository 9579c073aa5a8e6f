from tests.bundler.wheelhouse.conftest import runtime_bundle  # noqa: F401 - the session's runtime bundle
