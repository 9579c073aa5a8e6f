"""Options shared by the whole suite."""


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="Rewrite golden files (tests/**/golden/*) from the current code instead of comparing.")
