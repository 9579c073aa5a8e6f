"""The one place a command finds target profiles: the built-ins plus every user profile directory.

`bundle targets`, `bundle create --targets`, the engine planner and `--target auto` all ask here,
so a profile dropped into BUNDLE_PROFILE_DIR (or BUNDLE_HOME/profiles) means the same device to
each of them. manifests.targets does the parsing and never reads the environment; this module adds
the directories runtime.settings names, read at call time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from manifests import targets as _targets
from manifests.targets import TargetProfile
from runtime import settings
def _dirs(extra_dirs: Iterable[Path | str]) -> tuple[Path | str, ...]:
    return tuple(extra_dirs) + settings.profile_dirs()


def all_profiles(extra_dirs: Iterable[Path | str] = ()) -> list[TargetProfile]:
    """Built-ins, then `extra_dirs` (e.g. --profile-dir), then the settings' directories."""
    return _targets.all_profiles(_dirs(extra_dirs))


def get_profile(target_id: str, extra_dirs: Iterable[Path | str] = ()) -> TargetProfile:
    """The profile of `target_id`; UsageError listing the known ids when there is none."""
    return _targets.get_profile(target_id, _dirs(extra_dirs))


def parse_targets(text: str, extra_dirs: Iterable[Path | str] = ()) -> list[str]:
    """'jetson-thor,my-board' -> validated ids, in the order given (see manifests.targets.parse_targets)."""
    return _targets.parse_targets(text, _dirs(extra_dirs))
