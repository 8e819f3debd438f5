"""Per-head gates: learned Hard Concrete gates, fixed 0/1 masks, and the L0 penalty that prunes heads.

An attention layer multiplies each head's output [B, H, T, Dv] by that head's gate before the output projection
(:meth:`HeadkitGate.scale_heads`); a gate that reaches exactly 0 removes its head.

* :class:`HardConcreteGate` — the stochastic, differentiable relaxation of a 0/1 gate from Louizos, Welling &
  Kingma, "Learning Sparse Neural Networks through L0 Regularization" (ICLR 2018), Eq. 9–12, as used for
  attention heads by Voita, Talbot, Moiseev, Sennrich & Titov, "Analyzing Multi-Head Self-Attention:
  Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned" (ACL 2019), §4.
* :class:`FixedGate` — a constant 0/1 mask, for heads already chosen (ablation, or after pruning is decided).
* :func:`l0_penalty` / :func:`expected_open_heads` — the expected number of open heads, Σ P(gate ≠ 0).
* :class:`L0Controller` — the Lagrangian relaxation that steers that expectation to a target head count
  (Wang, Wohlwend & Lei, "Structured Pruning of Large Language Models", EMNLP 2020, Eq. 4).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

import torch
from torch import nn

from headkit.ops._validation import check_positive_int


class HeadkitGate(nn.Module):
    """Base class of every head gate: one value per head, multiplied into that head's output.

    Subclasses implement :meth:`forward` (the gate values to use now) and :meth:`probability_nonzero`
    (P(gate ≠ 0), whose sum over heads is the expected L0 norm). Layers call only :meth:`scale_heads`.
    """

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = check_positive_int("num_heads", num_heads)

    def forward(self) -> torch.Tensor:
        """Current gate values [num_heads], float32."""
        raise NotImplementedError

    def probability_nonzero(self) -> torch.Tensor:
        """P(gate ≠ 0) per head [num_heads], float32; differentiable where the gate is learned."""
        raise NotImplementedError

    def scale_heads(self, head_outputs: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
        """Multiply each head's slice of ``head_outputs`` by its gate.

        Args:
            head_outputs: per-head outputs, [B, H, T, Dv] by default; any rank whose axis ``head_dim`` has
                exactly ``num_heads`` entries.
            head_dim: the axis of ``head_outputs`` that indexes heads (1 for [B, H, T, Dv]; 2 for [B, T, H, Dv]).

        Returns:
            A tensor like ``head_outputs`` (same shape and dtype). In training mode a stochastic gate draws one
            sample per head for this call, shared by every batch element and position.
        """
        if not isinstance(head_outputs, torch.Tensor):
            raise ValueError(
                f"head_outputs must be a torch.Tensor with {self.num_heads} heads on axis head_dim, "
                f"got {type(head_outputs).__name__}"
            )
        rank = head_outputs.dim()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not -rank <= head_dim < rank:
            raise ValueError(
                f"head_dim must be an axis of head_outputs (an int in [{-rank}, {rank - 1}]), got {head_dim!r}"
            )
        head_dim %= rank
        if head_outputs.shape[head_dim] != self.num_heads:
            raise ValueError(
                f"head_outputs must have {self.num_heads} heads on axis {head_dim} (e.g. [batch, "
                f"{self.num_heads}, seq, head_dim_v]), got shape {tuple(head_outputs.shape)}"
            )
        broadcast_shape = [1] * rank
        broadcast_shape[head_dim] = self.num_heads
        gates = self().to(dtype=head_outputs.dtype, device=head_outputs.device)
        return head_outputs * gates.view(broadcast_shape)


class HardConcreteGate(HeadkitGate):
    """Learned stochastic gates, exactly 0 or 1 with non-zero probability and differentiable in ``log_alpha``.

    Louizos et al. 2018, with (l, r) = ``stretch``, β = ``temperature`` and one learned log α per head:

    * training (Eq. 9–10, one sample per head per call): u ~ U(0, 1),
      s = σ((log u − log(1 − u) + log α) / β),  g = min(1, max(0, s·(r − l) + l));
    * evaluation (the deterministic gate of §4.2): g = min(1, max(0, σ(log α)·(r − l) + l));
    * P(g ≠ 0) = σ(log α − β·log(−l / r))  (Eq. 12), the per-head term of the L0 penalty.

    Stretching s to (l, r) before clipping puts probability mass on exactly 0 and exactly 1, so a closed gate
    removes its head outright. Voita et al. 2019 (§4) put one such gate on every attention head.

    Args:
        num_heads: number of gates.
        temperature: β > 0; a lower temperature puts samples closer to 0/1 (Louizos et al. use 2/3).
        stretch: (l, r) with l < 0 < 1 < r.
        init_log_alpha: initial log α, a float for every head or a tensor [num_heads]. The default 3.0 starts
            from an almost unpruned model, as gating a pretrained one needs: every evaluation gate is exactly 1,
            ~90% of training samples are exactly 1 and P(g ≠ 0) ≈ 0.98, yet log α is not so large that the
            penalty gradient p·(1 − p) vanishes.
        hard: straight-through estimator: the forward value is 1 where g > 0.5 and 0 elsewhere, the gradient is
            that of g. :meth:`probability_nonzero` is then P(g > 0.5), the probability that this 0/1 value is 1.
        generator: random source for the training noise; torch's global generator when None, so
            ``torch.manual_seed`` reproduces the samples.
    """

    noise_eps = 1e-6  # u is kept in [eps, 1 − eps]: log u and log(1 − u) stay finite.

    def __init__(
        self,
        num_heads: int,
        temperature: float = 0.33,
        stretch: tuple[float, float] = (-0.1, 1.1),
        init_log_alpha: float | torch.Tensor = 3.0,
        hard: bool = False,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(num_heads)
        self.temperature = _check_positive_float("temperature", temperature)
        self.stretch = _check_stretch(stretch)
        if not isinstance(hard, bool):
            raise ValueError(f"hard must be a bool, got {hard!r}")
        self.hard = hard
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.generator = generator
        self.log_alpha = nn.Parameter(_initial_log_alpha(init_log_alpha, num_heads))

    def forward(self) -> torch.Tensor:
        log_alpha = self.log_alpha.float()
        low, high = self.stretch
        if self.training:
            noise = self._uniform_noise()
            concrete = torch.sigmoid((torch.log(noise) - torch.log1p(-noise) + log_alpha) / self.temperature)
        else:
            concrete = torch.sigmoid(log_alpha)
        gates = torch.clamp(concrete * (high - low) + low, 0.0, 1.0)
        if self.hard:
            # The forward value is the 0/1 gate exactly (gates − gates.detach() is exactly 0), the gradient is
            # that of the soft gate.
            return (gates > 0.5).float() + (gates - gates.detach())
        return gates

    def probability_nonzero(self) -> torch.Tensor:
        low, high = self.stretch
        log_alpha = self.log_alpha.float()
        if self.hard:
            # P(g > 0.5) = 1 − Q((0.5 − l) / (r − l)) with the binary-concrete CDF Q(s) = σ(β·logit(s) − log α).
            threshold = (0.5 - low) / (high - low)
            return torch.sigmoid(log_alpha - self.temperature * math.log(threshold / (1.0 - threshold)))
        return torch.sigmoid(log_alpha - self.temperature * math.log(-low / high))

    def _uniform_noise(self) -> torch.Tensor:
        # A generator lives on one device; draw there and move, so a CPU generator also drives a CUDA gate.
        device = self.log_alpha.device if self.generator is None else self.generator.device
        noise = torch.rand(self.num_heads, generator=self.generator, device=device, dtype=torch.float32)
        return noise.to(self.log_alpha.device).clamp(self.noise_eps, 1.0 - self.noise_eps)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, temperature={self.temperature}, stretch={self.stretch}, "
            f"hard={self.hard}"
        )


class FixedGate(HeadkitGate):
    """A constant 0/1 gate per head: 1 keeps a head, 0 removes it. Nothing is learned.

    Args:
        num_heads: number of gates.
        alive_heads: the heads kept; every head when None. Either an iterable of head indices in
            [0, num_heads) (a list, range or set of ints), or a tensor [num_heads] of bools or 0/1 values
            (a tensor is always read as a mask, never as indices).

    The mask is the buffer ``mask`` [num_heads] (float32, saved in the state dict), and also
    :meth:`probability_nonzero`.
    """

    mask: torch.Tensor

    def __init__(self, num_heads: int, alive_heads: Iterable[int] | torch.Tensor | None = None) -> None:
        super().__init__(num_heads)
        self.register_buffer("mask", _mask_from_alive_heads(alive_heads, self.num_heads))

    def forward(self) -> torch.Tensor:
        return self.mask.float()

    def probability_nonzero(self) -> torch.Tensor:
        return self.mask.float()

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, alive={int(self.mask.sum().item())}"


GATES: dict[str, type[HeadkitGate]] = {"hard_concrete": HardConcreteGate, "fixed": FixedGate}


def build_gate(kind: str, num_heads: int, **kwargs) -> HeadkitGate:
    """Build a gate by name from :data:`GATES`; ``kwargs`` go to its constructor."""
    if kind not in GATES:
        raise ValueError(f"kind must be one of {sorted(GATES)}, got {kind!r}")
    return GATES[kind](num_heads, **kwargs)


def l0_penalty(gates: Iterable[HeadkitGate]) -> torch.Tensor:
    """The expected L0 norm of all gated heads, Σ_heads P(gate ≠ 0) (Louizos et al. 2018, Eq. 12), a scalar.

    The penalty is a sum, not a mean: it is the expected number of open heads, so a coefficient λ on it costs
    the same per head in every model and ``λ · l0_penalty`` reads as "λ per open head". Differentiable in
    every learned gate's parameters; fixed gates add their constant count of kept heads.

    Args:
        gates: an iterable of :class:`HeadkitGate` (or one gate); at least one.
    """
    gates = _check_gates(gates)
    open_per_gate = [gate.probability_nonzero().sum() for gate in gates]
    device = open_per_gate[0].device  # gates of a model split over devices are summed on the first one
    return torch.stack([count.to(device) for count in open_per_gate]).sum()


def expected_open_heads(gates: Iterable[HeadkitGate]) -> float:
    """The value of :func:`l0_penalty` as a plain float, for logging and for reaching a head budget."""
    with torch.no_grad():
        return float(l0_penalty(gates).item())


class _GradientReversal(torch.autograd.Function):
    """Identity forward, negated gradient backward (the gradient reversal layer of Ganin & Lempitsky 2015)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return -grad_output


class L0Controller(nn.Module):
    """Drives the expected number of open heads to ``target_heads`` by Lagrangian relaxation.

    Wang et al. 2020 (Eq. 4) replace a fixed L0 coefficient, which needs a search to land on a head budget, by
    the saddle-point problem  min_gates max_{λ₁, λ₂}  task_loss + λ₁·(E[L0] − t) + λ₂·(E[L0] − t)²,
    with E[L0] = :func:`l0_penalty` and t = ``target_heads``. While the model has too many open heads, λ₁ and
    λ₂ grow and close heads harder; at the target the constraint term vanishes.

    The multipliers ``lambda_1`` and ``lambda_2`` are nn.Parameters (scalars, starting at 0) that are
    **maximised**: :meth:`penalty` reverses their gradient, so an ordinary minimising optimizer performs
    gradient ascent on them. Give them their own parameter group, :meth:`param_group`, with learning rate
    ``lr`` and no weight decay. ``target_heads`` may be reassigned during training (e.g. annealed from the full
    head count down to the budget, as Wang et al. do).

    Example:
        >>> import torch
        >>> from headkit.layers.gates import HardConcreteGate, L0Controller, expected_open_heads
        >>> _ = torch.manual_seed(0)
        >>> gates = [HardConcreteGate(12) for _ in range(4)]  # 4 layers of 12 heads
        >>> controller = L0Controller(target_heads=20, lr=0.05)
        >>> gate_params = [p for gate in gates for p in gate.parameters()]
        >>> optimizer = torch.optim.Adam([{"params": gate_params}, controller.param_group()], lr=0.05)
        >>> for step in range(300):
        ...     task_loss = sum(gate().sum() for gate in gates) * -0.01  # stands in for the model's loss
        ...     loss = task_loss + controller.penalty(gates)
        ...     optimizer.zero_grad()
        ...     loss.backward()
        ...     optimizer.step()
        >>> abs(expected_open_heads(gates) - 20) < 1
        True
    """

    def __init__(self, target_heads: float, lr: float = 0.05) -> None:
        super().__init__()
        self.target_heads = target_heads
        self.lr = _check_positive_float("lr", lr)
        self.lambda_1 = nn.Parameter(torch.zeros(()))
        self.lambda_2 = nn.Parameter(torch.zeros(()))

    @property
    def target_heads(self) -> float:
        return self._target_heads

    @target_heads.setter
    def target_heads(self, value: float) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value >= 0)
        ):
            raise ValueError(f"target_heads must be a non-negative number of heads, got {value!r}")
        self._target_heads = float(value)

    def penalty(self, gates: Iterable[HeadkitGate]) -> torch.Tensor:
        """λ₁·(E[L0] − t) + λ₂·(E[L0] − t)², a scalar to add to the task loss."""
        gates = _check_gates(gates)
        total_heads = sum(gate.num_heads for gate in gates)
        if self.target_heads > total_heads:
            raise ValueError(
                f"target_heads must be at most the {total_heads} gated heads, got {self.target_heads:g}"
            )
        gap = l0_penalty(gates) - self.target_heads
        lambda_1 = _GradientReversal.apply(self.lambda_1)
        lambda_2 = _GradientReversal.apply(self.lambda_2)
        return lambda_1 * gap + lambda_2 * gap**2

    def param_group(self) -> dict:
        """An optimizer parameter group for the multipliers: learning rate ``lr``, no weight decay."""
        return {"params": [self.lambda_1, self.lambda_2], "lr": self.lr, "weight_decay": 0.0}

    def extra_repr(self) -> str:
        return f"target_heads={self.target_heads:g}, lr={self.lr}"


def _check_positive_float(name: str, value: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a positive float, got {value!r}")
    return float(value)


def _check_stretch(stretch: tuple[float, float]) -> tuple[float, float]:
    try:
        low, high = (float(bound) for bound in stretch)
    except (TypeError, ValueError):
        raise ValueError(f"stretch must be a pair (l, r) with l < 0 < 1 < r, got {stretch!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < 0.0 and high > 1.0):
        raise ValueError(f"stretch must be a pair (l, r) with l < 0 < 1 < r, got {stretch!r}")
    return low, high


def _initial_log_alpha(init_log_alpha: float | torch.Tensor, num_heads: int) -> torch.Tensor:
    if isinstance(init_log_alpha, torch.Tensor):
        if tuple(init_log_alpha.shape) != (num_heads,) or not init_log_alpha.dtype.is_floating_point:
            raise ValueError(
                f"init_log_alpha must be a float or a float tensor of shape [num_heads] = [{num_heads}], "
                f"got a {init_log_alpha.dtype} tensor of shape {tuple(init_log_alpha.shape)}"
            )
        values = init_log_alpha.detach().to(torch.float32).clone()
    elif isinstance(init_log_alpha, (int, float)) and not isinstance(init_log_alpha, bool):
        values = torch.full((num_heads,), float(init_log_alpha))
    else:
        raise ValueError(
            f"init_log_alpha must be a float or a tensor of shape [num_heads] = [{num_heads}], "
            f"got {type(init_log_alpha).__name__}"
        )
    if not bool(torch.isfinite(values).all()):
        raise ValueError("init_log_alpha must be finite")
    return values


def _mask_from_alive_heads(alive_heads: Iterable[int] | torch.Tensor | None, num_heads: int) -> torch.Tensor:
    if alive_heads is None:
        return torch.ones(num_heads)
    if isinstance(alive_heads, torch.Tensor):
        if tuple(alive_heads.shape) != (num_heads,):
            raise ValueError(
                f"alive_heads as a tensor must be a mask of shape [num_heads] = [{num_heads}], "
                f"got shape {tuple(alive_heads.shape)}"
            )
        mask = alive_heads.detach().to(torch.float32)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("alive_heads as a tensor must hold only bools or 0/1 values")
        return mask.clone()
    try:
        indices = list(alive_heads)
    except TypeError:
        raise ValueError(
            f"alive_heads must be None, an iterable of head indices or a mask tensor [{num_heads}], "
            f"got {type(alive_heads).__name__}"
        ) from None
    mask = torch.zeros(num_heads)
    for index in indices:
        # bool is an int: [True, False] would silently mean heads 1 and 0; a mask must be a tensor.
        try:
            if isinstance(index, bool):
                raise TypeError
            index = operator.index(index)
        except TypeError:
            raise ValueError(
                f"alive_heads must hold int head indices (pass a mask as a tensor), got {index!r}"
            ) from None
        if not 0 <= index < num_heads:
            raise ValueError(f"alive_heads holds head index {index}, out of range [0, {num_heads})")
        mask[index] = 1.0
    return mask


def _check_gates(gates: Iterable[HeadkitGate]) -> list[HeadkitGate]:
    if isinstance(gates, HeadkitGate):
        return [gates]
    try:
        gates = list(gates)
    except TypeError:
        raise ValueError(
            f"gates must be an iterable of HeadkitGate modules, got {type(gates).__name__}"
        ) from None
    if not gates:
        raise ValueError("gates must hold at least one HeadkitGate, got an empty iterable")
    for gate in gates:
        if not isinstance(gate, HeadkitGate):
            raise ValueError(f"gates must hold only HeadkitGate modules, got {type(gate).__name__}")
    return gates
