"""The embedded demo pair: a small Llama target and its draft, trained on the CPython standard library.

Both are ordinary Hugging Face checkpoints committed to the repository, so `bundle create` with no `--model`
and the one-command demo work on a machine with no network. `train.py` rebuilds them; README.md has the numbers.
"""

from pathlib import Path

_HERE = Path(__file__).resolve().parent
DEMO_TARGET_DIR = _HERE / "models" / "target"
DEMO_DRAFT_DIR = _HERE / "models" / "draft"
#: The demo target's EAGLE-3 head (train_eagle3.py), the default of --speculative-config '{"method": "eagle3"}'
DEMO_EAGLE3_DIR = _HERE / "models" / "eagle3"
HELDOUT_PROMPTS = _HERE / "heldout_prompts.json"   # the chat questions the README's acceptance was measured on

__all__ = ["DEMO_TARGET_DIR", "DEMO_DRAFT_DIR", "DEMO_EAGLE3_DIR", "HELDOUT_PROMPTS"]
