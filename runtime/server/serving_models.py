"""GET /v1/models, and what /health and /health/ready report about the engine."""

from __future__ import annotations

from runtime.server import protocol as P

#: what /health says about the engine (runtime.server.loader.engine_info): what runs, why, and a warning
ENGINE_KEYS = ("engine", "engine_runs", "engine_reason", "engine_warning")


class ServingModels:
    def __init__(self, model, engine, slot_plan):
        self.model, self.engine, self.slot_plan = model, engine, slot_plan

    def list(self) -> dict:
        m = self.model
        cards = [P.ModelCard(id=name, created=m.created, max_model_len=m.max_model_len, root=m.info.get("root"))
                 for name in (m.aliases or (m.name,))]
        return P.ModelList(data=cards).model_dump()

    def health(self) -> dict:
        s, plan = self.engine.scheduler, self.slot_plan
        return {"status": "ok", "slots": s.num_slots, "running": s.num_running, "waiting": s.num_waiting,
                "kv_bytes_per_slot": plan.kv_bytes_per_slot, "kv_cache_bytes": plan.kv_bytes_per_slot * s.num_slots,
                "kv_budget_bytes": plan.kv_budget_bytes, "slots_limited_by": plan.limited_by,
                "max_num_batched_tokens": s.max_num_batched_tokens, "prefix_caching": s.enable_prefix_caching,
                **{k: v for k, v in (getattr(self.model, "info", None) or {}).items() if k in ENGINE_KEYS}}
