"""The learners: LoRA adapters or every decoder-layer parameter (the full-parameter baseline), trained on the target's
signal in a background worker and published as versions the draft swaps in between steps.

Serving-thread API (called by DraftEngine): `new_trajectory`, `record` (a verified step's teacher signal),
`finish` (a session ended), `before_step` (swap in the newest version; DraftEngine holds its step lock so no draft
forward is running). Everything else runs on the worker thread: sample the replay buffer, forward the window with
the trainable weights, KL against the target's top-k, the curriculum's weights, AdamW, and every `publish_every`
steps a detached copy of the weights as the next version. Losslessness does not depend on any of it: the draft only
proposes, verification is the target's, and a tree's draft probabilities are those of the version that drafted it.
"""
from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from evospec.adapt.lora import AdapterTable, first_adapted_layer, install_lora
from evospec.adapt.replay import Curriculum, Example, ReplayBuffer, Trajectory
from evospec.adapt.signal import TeacherSignal
from evospec.config import AdaptConfig
from evospec.model import Qwen3

log = logging.getLogger(__name__)
MB = 1 << 20


@dataclass
class AdaptStats:
    """What the learner reports (the service's metrics, `evospec bench adapt`)."""
    mode: str = "off"
    version: int = 0  # published versions swapped in by serving
    train_steps: int = 0
    loss: float = math.nan  # last training step's weighted KL
    loss_ema: float = math.nan
    focus: float = 1.0  # the curriculum's share of positions
    examples: int = 0  # in the replay buffer now
    examples_added: int = 0
    positions: int = 0  # teacher positions received
    signal_bytes: int = 0  # teacher payload received
    train_seconds: float = 0.0  # worker compute time
    state_bytes: int = 0  # trainable weights + gradients + optimizer + published copy + replay buffer
    skipped_steps: int = 0  # steps whose loss was not finite (not applied)
    error: str = ""  # the worker stopped on this error (serving goes on with the last version)
    losses: list[float] = field(default_factory=list, repr=False)  # per training step (bounded)


def distill_kl(hidden: torch.Tensor, head: torch.Tensor, teacher_ids: torch.Tensor,
               teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """hidden: [P, H]; head: [V, H]; teacher_*: [P, k] -> [P] KL(p̂ ‖ q) with p̂ the target's top-k renormalized and
    q the draft's full-vocabulary distribution (read at those k ids)."""
    logq = torch.log_softmax((hidden.to(head.dtype) @ head.t()).float(), dim=-1)  # [P, V]
    logq_k = logq.gather(1, teacher_ids.to(logq.device, torch.long))  # [P, k]
    logp = torch.log_softmax(teacher_logprobs.to(logq.device, torch.float32), dim=-1)  # [P, k]
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq_k), 0.0).sum(-1)  # ids with p = 0 (log-prob -inf) add nothing


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _tensors_of(weights) -> list[torch.Tensor]:
    """The tensors of a published version (LoRA: {name: (A, B)}; full: [{name: tensor}] per layer)."""
    if isinstance(weights, dict):
        return [t for pair in weights.values() for t in pair]
    return [t for layer in weights for t in layer.values()]


class Learner:
    """Replay, curriculum, worker, versions; subclasses say what is trained (`_trainable`, `_training_forward`,
    `_publishable`, `_apply`, `_state_dict`)."""
    mode = "base"

    def __init__(self, model: Qwen3, cfg: AdaptConfig):
        self.model, self.cfg = model, cfg
        for p in model.parameters():
            p.requires_grad_(False)  # serving weights never collect gradients
        self.device = model.embed_tokens.weight.device
        self.replay = ReplayBuffer(cfg.replay_size, int(cfg.replay_mb * MB), cfg.seed)
        self.curriculum = Curriculum(cfg.focus_start)
        self.stats = AdaptStats(mode=self.mode)
        self._pending: tuple[int, object] | None = None  # (version, publishable) not swapped in yet
        self._published = 0
        self._pending_lock = threading.Lock()  # the hand-over only: serving never waits for training
        self._train_lock = threading.RLock()  # a training step, publishing, export and load: one at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    # -- memory -------------------------------------------------------------------------------------------------
    def estimate_bytes(self) -> int:
        """Steady state when training: trainable fp32 + gradient + AdamW's two moments, a served and a pending
        version in the model's dtype, and the replay buffer at its cap."""
        params = sum(p.numel() for p in self._trainable())
        version = params * self.model.embed_tokens.weight.element_size()
        return params * 4 * 4 + 2 * version + int(self.cfg.replay_mb * MB)

    def check_memory_cap(self) -> None:
        need = self.estimate_bytes() / MB
        if need > self.cfg.memory_cap_mb:
            raise ValueError(f"adaptation ({self.mode}) needs about {need:.0f} MB (weights, gradients, optimizer, "
                             f"replay); adapt.memory_cap_mb is {self.cfg.memory_cap_mb:.0f}: lower the rank or "
                             f"replay_mb, or raise the cap")

    def state_bytes(self) -> int:
        trainable = self._trainable()
        grads = [p.grad for p in trainable if p.grad is not None]
        moments = [v for s in (self.optimizer.state.values() if self.optimizer else ()) for v in s.values()
                   if isinstance(v, torch.Tensor)]
        pending = self._pending
        pending_bytes = 0 if pending is None else tensor_bytes(_tensors_of(pending[1]))
        return tensor_bytes(trainable) + tensor_bytes(grads) + tensor_bytes(moments) + self._published_bytes() + \
            pending_bytes + self.replay.nbytes

    # -- serving thread -----------------------------------------------------------------------------------------
    def new_trajectory(self) -> Trajectory:
        return Trajectory(self.cfg.window, self.cfg.positions_per_example)

    def record(self, trajectory: Trajectory, tokens: list[int], first_position: int, signal: TeacherSignal,
               accepted: int) -> None:
        """A verified step's signal; `tokens` = the session's committed sequence, already including the step."""
        trajectory.add(first_position, signal, accepted)
        self.stats.positions += signal.positions
        self.stats.signal_bytes += signal.nbytes
        if trajectory.ready:
            self._add(trajectory.cut(tokens))

    def finish(self, trajectory: Trajectory, tokens: list[int]) -> None:
        self._add(trajectory.cut(tokens))

    def _add(self, example: Example | None) -> None:
        if example is not None:
            self.replay.add(example)
            self.stats.examples, self.stats.examples_added = len(self.replay), self.replay.added

    def before_step(self) -> None:
        """Swap in the newest published version (the caller guarantees no draft forward is running)."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            version, weights = pending
            self._apply(weights)
            self.stats.version = version

    # -- worker -------------------------------------------------------------------------------------------------
    def start(self) -> "Learner":
        self.check_memory_cap()
        self._thread = threading.Thread(target=self._work, name=f"evospec-adapt-{self.mode}", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _work(self) -> None:
        torch.set_num_threads(self.cfg.train_threads)  # this thread's own pool: serving keeps its threads
        try:
            while not self._stop.is_set():
                if len(self.replay) < self.cfg.min_examples:
                    self._stop.wait(0.05)
                    continue
                start = time.perf_counter()
                loss = self.train_step()
                seconds = time.perf_counter() - start
                self.stats.train_seconds += seconds
                if math.isfinite(loss) and self.stats.train_steps % self.cfg.publish_every == 0:
                    self.publish()
                share = self.cfg.max_time_share  # sleep so that compute stays within its share of wall time
                self._stop.wait(seconds * (1.0 - share) / share)
        except Exception as exc:  # noqa: BLE001 - serving goes on with the last version
            log.exception("adaptation worker stopped")
            self.stats.error = f"{type(exc).__name__}: {exc}"

    def train_step(self) -> float:
        """One AdamW step on a batch sampled from the replay buffer; returns the weighted KL (a step whose loss is
        not finite is skipped)."""
        with self._train_lock:
            return self._train_step()

    def _train_step(self) -> float:
        batch = self.replay.sample(self.cfg.batch_size)
        head = self.model.head_weight
        total = 0.0
        first = self.first_trained_layer
        for example in batch:  # one backward per example: activations of one window alive at a time
            prefix = example.prefix_hidden
            if first > 0 and prefix is None:  # frozen layers: run once per example, then kept with it
                prefix = self.model.forward_layers(example.input_ids, first)
                self.replay.cache_prefix(example, prefix)
            with self._training_forward() as layers:
                hidden = self.model.forward_train(example.input_ids, layers, first, prefix)  # [L, H]
                kl = distill_kl(hidden[example.rows.to(hidden.device)], head, example.teacher_ids,
                                example.teacher_logprobs)  # [P]
                weights = self.curriculum.weights(kl.detach().cpu(), example.accepted).to(kl.device)
                loss = (weights * kl).sum()
                (loss / len(batch)).backward()
            example.priority = float(kl.detach().mean())
            total += float(loss.detach())
        loss = total / max(1, len(batch))
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=False)
            self.stats.skipped_steps += 1
            return loss
        nn.utils.clip_grad_norm_(self._trainable(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # keep the gradient buffers: steady memory, no churn
        self.curriculum.update(loss)
        s = self.stats
        s.train_steps += 1
        s.loss, s.loss_ema, s.focus = loss, self.curriculum.ema, self.curriculum.focus
        s.losses = (s.losses + [loss])[-4096:]
        s.state_bytes = self.state_bytes()
        return loss

    def publish(self) -> int:
        """A detached copy of the trainable weights becomes the next version (swapped in by `before_step`)."""
        with self._train_lock:
            weights = self._publishable()
            with self._pending_lock:
                self._published += 1
                self._pending = (self._published, weights)
                version = self._published
        if self.cfg.checkpoint and self.cfg.checkpoint_every and version % self.cfg.checkpoint_every == 0:
            self.export(self.cfg.checkpoint)
        return version

    # -- files ----------------------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        c = self.model.cfg
        return {"format": "evospec-adapter", "mode": self.mode, "rank": str(self.cfg.rank),
                "alpha": str(self.cfg.alpha), "modules": ",".join(self.cfg.modules),
                "layers": str(self.first_trained_layer),
                "base": f"{c.num_hidden_layers}x{c.hidden_size}/{c.vocab_size}", "version": str(self._published)}

    def export(self, path: str | Path) -> Path:
        """Save the trainable weights (not the optimizer state) and what they fit, as safetensors."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._train_lock:  # a consistent copy: never in the middle of a training step
            tensors = {k: v.detach().clone().contiguous() for k, v in self._state_dict().items()}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=self.metadata())
        tmp.replace(path)  # atomic: a restart never reads half a file
        return path

    def load(self, path: str | Path) -> int:
        """Load an exported file into the trainable weights and publish it; returns the new version."""
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path), device=str(self.device))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"not a readable safetensors adapter file ({type(exc).__name__})") from None
        mine = self.metadata()
        for key in ("format", "mode", "rank", "alpha", "modules", "layers", "base"):
            if meta.get(key) != mine[key]:
                raise ValueError(f"adapter {key} is {meta.get(key)!r}; this draft needs {mine[key]!r}")
        with torch.no_grad(), self._train_lock:  # between training steps: no saved tensor changes under autograd
            own = self._state_dict()
            if set(tensors) != set(own) or any(tensors[k].shape != own[k].shape for k in own):
                raise ValueError(f"adapter tensors do not match this draft's {self.mode} weights")
            for key, value in tensors.items():
                own[key].copy_(value)
            return self.publish()

    # -- what is trained (subclasses) -----------------------------------------------------------------------------
    first_trained_layer = 0  # layers below it are frozen: their output is computed once per example

    def _trainable(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _training_forward(self):
        """A context manager for one example's forward, yielding the decoder layers for `forward_train` (None =
        the model's own)."""
        raise NotImplementedError

    def _publishable(self) -> object:
        raise NotImplementedError

    def _published_bytes(self) -> int:
        raise NotImplementedError

    def _apply(self, weights: object) -> None:
        raise NotImplementedError

    def _state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class LoRALearner(Learner):
    """Adapters A [r, in] (Kaiming-uniform) and B [out, r] (zeros, so version 0 is the base model) on every
    wrapped projection, fp32 masters; published as (A, B·alpha/r) in the model's dtype."""
    mode = "lora"

    def __init__(self, model: Qwen3, cfg: AdaptConfig):
        super().__init__(model, cfg)
        self.bank, self.layers = install_lora(model, cfg.modules, cfg.layers)
        self.first_trained_layer = first_adapted_layer(len(model.layers), cfg.layers)
        self.scale = cfg.alpha / cfg.rank
        generator = torch.Generator().manual_seed(cfg.seed)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            bound = 1.0 / math.sqrt(layer.in_features)
            a = (torch.rand(cfg.rank, layer.in_features, generator=generator) * 2 - 1) * bound
            self.a[name] = a.to(self.device).requires_grad_()
            self.b[name] = torch.zeros(layer.out_features, cfg.rank, device=self.device, requires_grad=True)
        self.optimizer = torch.optim.AdamW(self._trainable(), lr=cfg.lr, weight_decay=0.0)

    def _trainable(self) -> list[torch.Tensor]:
        return [*self.a.values(), *self.b.values()]

    @contextmanager
    def _training_forward(self) -> Iterator[None]:
        table = {name: (self.a[name], self.b[name] * self.scale) for name in self.layers}
        with self.bank.training(table):
            yield None

    def _publishable(self) -> AdapterTable:
        dtype = self.model.embed_tokens.weight.dtype
        with torch.no_grad():
            return {name: (self.a[name].detach().to(dtype).clone(), (self.b[name].detach() * self.scale).to(dtype))
                    for name in self.layers}

    def _published_bytes(self) -> int:
        return tensor_bytes(_tensors_of(self.bank.serving or {}))

    def _apply(self, weights: AdapterTable) -> None:
        self.bank.serving = weights  # one reference: every later forward reads this version whole

    def _state_dict(self) -> dict[str, torch.Tensor]:
        return {**{f"{n}.lora_A": t for n, t in self.a.items()}, **{f"{n}.lora_B": t for n, t in self.b.items()}}


class FullLearner(Learner):
    """The full-parameter baseline (online distillation as in OSD, arXiv 2310.07177): an fp32 trainable copy of every
    decoder-layer parameter with AdamW's state; a version replaces the serving layers' parameters. Float drafts only
    (int8 layers have no trainable weights)."""
    mode = "full"

    def __init__(self, model: Qwen3, cfg: AdaptConfig):
        if model.weight_format != "none":
            raise ValueError(f"adapt.mode 'full' trains float weights; this draft's layers are quantized "
                             f"(model.quantize: {model.weight_format}). Use quantize: none, or adapt.mode: lora")
        super().__init__(model, cfg)
        # The worker's own fp32 copy of the layers: training never touches the modules serving reads.
        self.train_layers = copy.deepcopy(model.layers).float().requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self._trainable(), lr=cfg.lr, weight_decay=0.0)

    def _trainable(self) -> list[torch.Tensor]:
        return list(self.train_layers.parameters())

    @contextmanager
    def _training_forward(self) -> Iterator[nn.ModuleList]:
        yield self.train_layers

    def _publishable(self) -> list[dict[str, torch.Tensor]]:
        dtype = self.model.embed_tokens.weight.dtype
        with torch.no_grad():
            return [{n: p.detach().to(dtype).clone() for n, p in layer.named_parameters()}
                    for layer in self.train_layers]

    def _published_bytes(self) -> int:
        return 0  # a version replaces the serving weights, which exist without adaptation too

    def _apply(self, weights: list[dict[str, torch.Tensor]]) -> None:
        for layer, new in zip(self.model.layers, weights):
            own = dict(layer.named_parameters())
            for name, value in new.items():
                own[name].data = value

    def _state_dict(self) -> dict[str, torch.Tensor]:
        return {f"layers.{i}.{n}": p for i, layer in enumerate(self.train_layers) for n, p in layer.named_parameters()}


def build_learner(model: Qwen3, cfg: AdaptConfig) -> Learner | None:
    """The learner of `cfg.mode` (None for off), memory-checked and with `cfg.checkpoint` restored when it exists.
    Call `start()` to run its worker."""
    if not cfg.enabled:
        return None
    learner = LoRALearner(model, cfg) if cfg.mode == "lora" else FullLearner(model, cfg)
    learner.check_memory_cap()
    if cfg.checkpoint and Path(cfg.checkpoint).exists():
        learner.load(cfg.checkpoint)
    return learner
