"""`bundle create`'s progress where stderr is not a terminal: log lines instead of bars.

Under CI, nohup or `2> create.log` tqdm's bars are off, and a create of a large model runs for an hour
with nothing to show. So the build-host modules log an INFO line as each stage starts or ends (resolve,
wheelhouse, export, engines, pack, sign, verify: the line starts with the stage's name) and one per
file of at least LARGE_FILE_BYTES as it is packed, with its size; `bundle create` sends the `bundler`
loggers (these lines and the modules' other INFO lines) to stderr, timestamped, while it runs, unless
stderr is a terminal (the bars show there) or --no-progress is given. Library callers see the lines
wherever they configure logging.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator, TextIO

#: files at least this large get a line of their own as they are packed (smaller ones only count)
LARGE_FILE_BYTES = 64 * 1024 * 1024
#: the loggers whose lines are create's progress (every build-host module logs under it)
LOGGER = "bundler"
FORMAT = "%(asctime)s bundle create: %(message)s"


def lines_wanted(progress: bool, stream: TextIO | None = None) -> bool:
    """Log lines instead of bars: progress asked for and the stream is not a terminal."""
    stream = stream if stream is not None else sys.stderr
    return progress and not (hasattr(stream, "isatty") and stream.isatty())


@contextmanager
def progress_lines(enabled: bool, stream: TextIO | None = None) -> Iterator[None]:
    """While open (and `enabled`): the `bundler` loggers' INFO lines go to `stream` (stderr), timestamped."""
    if not enabled:
        yield
        return
    logger = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, "%Y-%m-%dT%H:%M:%S"))
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
