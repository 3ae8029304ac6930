"""A small model of one engine step at concurrency 1: co-located vs decoupled vs decoupled with pre-drafting.

    co-located   t = D_co + V_co                         (one device runs both models, one after the other)
    decoupled    t = D + T + V                           (each model on its own device, still one after the other)
    overlap      t = h (max(V, P) + T) + (1 - h) (V + T + D + f)

(when only a share s of the steps drafts, the draft terms weigh s: decoupled t = V + s (D + T), and so on)

V: the target's verify forward; D: drafting one tree; T: the round trip's transport and codec; P: pre-drafting the M
likeliest outcomes while the target verifies (it starts when the tree leaves, so it is hidden while P <= V); h: the
share of steps whose tree was pre-drafted; f: the forward a stopped pre-draft may still finish on a miss (one draft
forward); tau: tokens committed per step. Throughput = tau / t (tokens per second at concurrency 1).

`from_profile` reads the terms from a measured step profile (evospec/engine/profile.py), so the model can be checked
against what `evospec bench decoupled` measured; docs/decoupled.md applies it to published H200 costs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds per step (draft terms per drafting step), tokens per step, and the pre-draft hit share."""
    verify: float  # V
    draft: float  # D
    transport: float  # T
    predraft: float  # P
    draft_forward: float  # f
    tau: float
    hit: float  # h
    other: float = 0.0  # the step's own bookkeeping (admit, plan, commit, flush)
    drafting: float = 1.0  # s: share of the steps that drafted a tree

    def decoupled_ms(self) -> float:
        return self.verify + self.other + self.drafting * (self.draft + self.transport)

    def overlap_ms(self) -> float:
        hit = max(0.0, self.predraft - self.verify) + self.transport  # beyond the verify
        miss = self.transport + self.draft + self.draft_forward
        return self.verify + self.other + self.drafting * (self.hit * hit + (1 - self.hit) * miss)

    def tokens_per_s(self, step_ms: float) -> float:
        return 1000 * self.tau / step_ms


def from_profile(profile: dict, stats: list[dict], levels: float) -> StepCosts:
    """The model's terms from one cell of `evospec bench decoupled` (its profile and per-request statistics);
    `levels`: draft forwards per tree (for f = D / levels)."""
    steps = max(1, profile["steps"])
    seconds = profile["seconds"]
    ms = {k: 1000 * v / steps for k, v in seconds.items()}
    drafting = sum(n for depth, n in profile.get("depths", {}).items() if int(depth) > 0)
    per_drafting = steps / max(1, drafting)  # the draft terms are paid only on steps that drafted
    draft = ms.get("draft.remote_compute", 0.0) * per_drafting
    transport = (ms.get("draft", 0.0) - ms.get("draft.remote_compute", 0.0)) * per_drafting
    committed = sum(s["generated_tokens"] for s in stats)
    used = sum(s.get("predrafted_steps", 0) for s in stats)
    other = sum(ms.get(k, 0.0) for k in ("admit", "plan", "commit", "feedback", "flush"))
    return StepCosts(verify=ms.get("verify", 0.0), draft=draft, transport=transport,
                     predraft=ms.get("draft.remote_predraft", 0.0) * per_drafting,
                     draft_forward=draft / max(levels, 1.0), tau=committed / steps,
                     hit=used / drafting if drafting else 0.0, other=other, drafting=drafting / steps)


# Qwen3-1.7B -> Qwen3-4B on two H200s, batch 1, chain drafts: estimates derived in docs/decoupled.md (bandwidth-scaled
# from a measured RTX 5090 decode step; 0.2 ms per internal message measured on CPU), not measurements.
H200_VERIFY_MS, H200_DRAFT_FORWARD_MS, H200_TRANSPORT_MS = 2.4, 1.0, 0.4


def h200_projection(hits: tuple[float, ...] = (0.5, 0.7), depths: tuple[int, ...] = (4, 3)) -> list[dict]:
    """Step time of each shape at equal tau (so the ratios are throughput ratios), per chain depth and hit share."""
    rows = []
    for depth in depths:
        f = H200_DRAFT_FORWARD_MS
        base = StepCosts(verify=H200_VERIFY_MS, draft=depth * f, transport=H200_TRANSPORT_MS,
                         predraft=(depth + 1) * f, draft_forward=f, tau=1.0, hit=0.0)
        colocated = base.draft + base.verify
        rows.append({"shape": f"co-located, chain {depth}", "ms": colocated})
        rows.append({"shape": f"decoupled, chain {depth}", "ms": base.decoupled_ms()})
        for h in hits:
            rows.append({"shape": f"overlap h={h}, chain {depth}", "ms": replace(base, hit=h).overlap_ms()})
        for row in rows[-2 - len(hits):]:
            row["vs_colocated"] = colocated / row["ms"]
    return rows


if __name__ == "__main__":
    for row in h200_projection():
        print(f"| {row['shape']} | {row['ms']:.2f} | {row.get('vs_colocated', 1.0):.2f} |")
