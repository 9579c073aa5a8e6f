"""Every choice the adaptive speculation length makes, over fake-clock scenarios: one digest per scenario.

Run by hand, before and after a change to runtime.serve.spec_length or runtime.serve.spec_referee that is meant
to leave behaviour as it was (a refactor), and compare the outputs:
    .venv/bin/python benchmarks/trace_spec_length.py > /tmp/before.txt   # on the old code
    .venv/bin/python benchmarks/trace_spec_length.py > /tmp/after.txt    # on the new
    diff /tmp/before.txt /tmp/after.txt

Why: the length's choices depend on long histories (probes, trials, explorations, back-offs), which unit tests
sample at a few points. Here the scheduler and model runner drive the zero-cost Markov engines of
bench_step_overhead.py on its fake clock for every method, 1 to 32 slots and four cost shapes (drafting cheap,
dear, launch-bound, row-bound), requests of random lengths coming and going, some sampled with a seed (which keep
the fixed length); each step's bucket, G and per-slot lengths go into the scenario's digest, with the steps run by
length and the proposals withheld. Nothing reads the wall clock, so the digests are the same on any machine; the
G counts beside each say what the scenario exercised.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step_overhead import PROMPT, VOCAB, Clock, TimedHead, TimedSlots  # noqa: E402
from runtime.serve.model_runner import ModelRunner  # noqa: E402
from runtime.serve.sampling import SamplingParams  # noqa: E402
from runtime.serve.scheduler import EngineRequest, Scheduler  # noqa: E402

#: (target row seconds, draft forward or head run seconds, target call seconds, the draft table's distance)
COSTS = ((0.00002, 0.0001, 0.001, 1.0), (0.0001, 0.0009, 0.0, 3.0), (0.00002, 0.004, 0.003, 0.5),
         (0.0005, 0.0002, 0.0005, 2.0))
STEPS = 3000


def scenario(method: str, slots: int, row_s: float, draft_s: float, call_s: float, noise: float,
             seed: int, steps: int = STEPS) -> tuple[str, list[int]]:
    """(digest of every choice, steps per G)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * 3
    other = table + rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * noise
    clock = Clock()
    target = TimedSlots(table, clock, call_s, row_s, method == "eagle3", num_slots=slots, max_context=100_000)
    draft = {"draft_model": lambda: TimedSlots(other, clock, draft_s, 0.0, num_slots=slots, max_context=100_000),
             "eagle3": lambda: TimedHead(other, clock, draft_s)}.get(method, lambda: None)()
    runner = ModelRunner(target, draft, method, 3, clock=clock)
    scheduler = Scheduler(runner, max_num_seqs=slots)

    def add() -> None:
        seeded = rng.random() < 0.3
        params = SamplingParams(temperature=0.8, seed=int(rng.integers(1 << 30))) if seeded else \
            SamplingParams(temperature=0.0)
        scheduler.add(EngineRequest(prompt=[int(t) for t in rng.integers(0, VOCAB, int(rng.integers(5, PROMPT)))],
                                    params=params, max_tokens=int(rng.integers(20, 400))))

    for _ in range(slots + 2):
        add()
    digest, lengths = hashlib.sha256(), [0] * 4
    spec = runner.speculation
    for i in range(steps):
        done = scheduler.step()
        digest.update(repr((spec._bucket, spec.last, sorted(spec._slot_lengths.values()))).encode())
        lengths[spec.last] += 1
        for _ in done or ():
            add()
        if i % 700 == 350:  # a wave of arrivals
            for _ in range(slots):
                add()
    digest.update(repr((sorted(spec.steps_run().items()), spec.withheld_proposals())).encode())
    return digest.hexdigest()[:16], lengths


def main() -> int:
    for method in ("draft_model", "eagle3", "ngram"):
        for slots in (1, 4, 8, 32):
            for row_s, draft_s, call_s, noise in COSTS:
                digest, lengths = scenario(method, slots, row_s, draft_s, call_s, noise, seed=slots)
                print(f"{method} slots={slots} row={row_s} draft={draft_s} call={call_s} noise={noise} {digest} "
                      f"G0..3={lengths}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
