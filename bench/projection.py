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
against what `evospec bench decoupled` measured. `from_gpu_check` reads them from scripts/gpu_check.sh's JSON
(forward costs, and engine steps of the Qwen3-1.7B/4B shapes with the real pair's acceptance replayed, so each arm's
τ is measured in the same run as its cost), and gives the seed table's rows (AR, SD, FR-Spec 32k, EvoSpec
32k+256; co-located, decoupled, decoupled with overlap), saying which inputs were measured on a GPU. Without that
JSON, `h200_projection` applies the model to published H200 costs (docs/decoupled.md).

    python -m evospec.bench.projection [--gpu-check results/gpu/gpu_check.json]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from evospec.config import TreeParams


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


# gpu_check's (method, tree) rows by the arm names of `evospec bench real` (whose acceptance they replay).
ARMS = {("ar", "none"): "ar", ("sd", "chain"): "sd", ("sd", "tree"): "sd-tree", ("frspec", "chain"): "frspec-32k",
        ("frspec", "tree"): "frspec-32k-tree", ("evospec", "chain"): "evospec-32k+256",
        ("evospec", "tree"): "evospec-32k+256-tree"}
CPU_TRANSPORT_MS = 0.4  # one internal round trip's codec and gRPC, measured on CPU (docs/decoupled.md)


def interpolate(ms_by_size: dict, size: float) -> float:
    """ms at `size` from a {size: ms} table (JSON keys are strings), linear between measured sizes."""
    table = sorted((int(k), v) for k, v in ms_by_size.items())
    if size <= table[0][0]:
        return table[0][1]
    for (a, ya), (b, yb) in zip(table, table[1:]):
        if size <= b:
            return ya + (yb - ya) * (size - a) / (b - a)
    (a, ya), (b, yb) = table[-2], table[-1]
    return yb + (yb - ya) * (size - b) / (b - a)


def from_gpu_check(check: dict, hit: float = 0.5) -> dict:
    """Rows of the seed table from gpu_check.json: per arm, τ (the expectation of the real pair's acceptance by
    depth that the engine run replayed), ms per step and tokens/s co-located (measured: both models in one process
    on one device), decoupled (modelled: the target's verify forward + the draft's levels + transport + the engine's
    bookkeeping, each model on its own device) and with overlap (pre-drafting hides drafting on `hit` of the
    steps)."""
    engine, forward = check["engine_ms_per_step"], check["forward_ms"]
    transport, transport_source = decoupled_transport(check)
    rows = []
    for row in engine["rows"]:
        arm = ARMS[(row["method"], row["tree"])]
        shape = TreeParams(**(engine["chain"] if row["tree"] == "chain" else engine["tree"]))
        nodes, levels = (0, 0) if arm == "ar" else (shape.max_nodes, shape.levels)
        per_level = nodes / levels if levels else 0  # rows each draft forward runs
        f = interpolate(forward["draft"]["by_new_tokens"], per_level) if levels else 0.0
        verify = interpolate(forward["target"]["by_new_tokens"], 1 + nodes)
        other = max(0.0, row["ms_per_step"] - verify - levels * f)  # the engine's own work, as measured co-located
        costs = StepCosts(verify=verify, draft=levels * f, transport=transport if levels else 0.0,
                          predraft=(levels + 1) * f, draft_forward=f, tau=row["expected_tau"],
                          hit=hit if levels else 0.0, other=other)
        decoupled, overlap = costs.decoupled_ms(), costs.overlap_ms()
        rows.append({"arm": arm, "tau": row["expected_tau"], "colocated_ms": row["ms_per_step"],
                     "colocated_tok_s": costs.tokens_per_s(row["ms_per_step"]),
                     "decoupled_ms": decoupled, "decoupled_tok_s": costs.tokens_per_s(decoupled),
                     "overlap_ms": overlap, "overlap_tok_s": costs.tokens_per_s(overlap)})
    ar = next(r for r in rows if r["arm"] == "ar")
    for r in rows:
        for shape in ("colocated", "decoupled", "overlap"):
            r[f"{shape}_vs_ar"] = r[f"{shape}_tok_s"] / ar[f"{shape}_tok_s"]
    on_gpu = check["mode"] == "gpu"
    device = check["environment"].get("device")
    return {"rows": rows, "hit": hit, "inputs": {
        "forward and engine step costs": f"measured on {device}" if on_gpu else
        f"measured on the CPU with tiny shapes ({check['environment']['cpu']}): not a GPU figure",
        "tau per arm": "1 + the sum of the acceptance by depth the engine steps replayed, from the real pair "
                       "(Qwen2.5-Coder 0.5B -> 1.5B on CPU, greedy, medical: "
                       f"{check['engine_ms_per_step']['acceptance_source']}): not Qwen3's",
        "transport per step": transport_source,
        "draft forward": "timed with the full LM head: FR-Spec's and EvoSpec's pruned heads cost less, so their "
                         "decoupled and overlap rows are upper bounds on step time",
        "engine bookkeeping": "the co-located step minus its forwards, added to the decoupled step too",
        "pre-draft hit share": f"assumed {hit}"}}


def decoupled_transport(check: dict) -> tuple[float, str]:
    """ms of transport per drafting step: from the check's own `bench decoupled` breakdown when that step ran (on
    the check's device), else the CPU measurement."""
    result = check.get("decoupled", {})
    path = Path(result.get("json", ""))
    if result.get("rc") == 0 and path.is_file():
        profiles = json.loads(path.read_text())["profiles"]
        transports = sorted(from_profile(p, [], levels=1).transport for name, runs in profiles.items()
                            if name.startswith("decoupled ") and not name.startswith("decoupled ar") for p in runs)
        if transports:
            return (transports[len(transports) // 2],
                    f"median of bench decoupled's profiles on {check['environment'].get('device')} (tiny pair)")
    return CPU_TRANSPORT_MS, f"{CPU_TRANSPORT_MS} ms, measured on CPU (the check's decoupled step did not run)"


def print_gpu_table(table: dict) -> None:
    print("| arm | τ | co-located ms | tok/s | ×ar | decoupled ms | tok/s | ×ar | overlap ms | tok/s | ×ar |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table["rows"]:
        print(f"| {r['arm']} | {r['tau']:.2f} | " + " | ".join(
            f"{r[f'{s}_ms']:.2f} | {r[f'{s}_tok_s']:.1f} | {r[f'{s}_vs_ar']:.2f}"
            for s in ("colocated", "decoupled", "overlap")) + " |")
    print()
    for what, source in table["inputs"].items():
        print(f"- {what}: {source}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-check", type=Path, help="scripts/gpu_check.sh's gpu_check.json")
    ap.add_argument("--hit", type=float, default=0.5, help="share of steps whose tree was pre-drafted")
    args = ap.parse_args(argv)
    if args.gpu_check is not None and not args.gpu_check.is_file():
        ap.error(f"--gpu-check: no file {args.gpu_check}")
    if not 0.0 <= args.hit <= 1.0:
        ap.error(f"--hit: a share of steps, in [0, 1]; got {args.hit}")
    if args.gpu_check:
        print_gpu_table(from_gpu_check(json.loads(args.gpu_check.read_text()), args.hit))
        return
    print("Estimates from published H200 costs, not measurements (run scripts/gpu_check.sh on a GPU, then pass "
          "--gpu-check):")
    for row in h200_projection():
        print(f"| {row['shape']} | {row['ms']:.2f} | {row.get('vs_colocated', 1.0):.2f} |")


if __name__ == "__main__":
    main()
