"""A whole cohort's local work as one batched computation (the vectorized engine's client side).

Each sampled client does exactly what :mod:`fedhog.client_app` does — local
SGD with momentum over :func:`~fedhog.training.local_batches`, then, for
``hog``, the third-order term t = ∇_θ(vᵀ∇²L(θ)v) at the global model on
:func:`~fedhog.training.hog_rows` — but the K clients run together:
parameters are stacked ``[K, …]`` and every step is one
batched forward (``torch.func.vmap`` over the clients) and one backward; the third-order terms are one
vmapped Taylor-mode forward and one backward (:meth:`CohortTrainer._third_order_terms`). Clients have different
numbers of examples, so step s gathers each client's s-th minibatch padded to
the longest with a mask (padded examples weigh nothing), and only the clients
that still have a minibatch compute and step: the clients are ordered by their
number of steps, most first (they all start from the same model, so the order
costs nothing), and step s trains the first ones as a slice of the stacked
parameters, so every client takes exactly the steps of the per-client loop
and none computes a step it does not take. The
results equal the ClientApp's up to floating-point reassociation inside the
batched kernels.

The population's training data is moved to the device once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from ..derivatives import Unsupported
from ..derivatives.engine import random_directions as hutchinson_directions
from ..derivatives.taylor import TaylorProgram, cross_entropy_series, program_for
from ..layout import flatten, unflatten
from ..privacy.noise_aware import local_step_scale
from ..training import (
    control_term_seed,
    epoch_orders,
    minibatches,
    random_direction,
    random_directions,
    unit_directions,
)

TERM_CLIENTS_PER_PASS = 64
"""Clients whose third-order terms one vmapped pass computes at most. It bounds the pass's memory in a large
cohort; measured on a cohort of 100 (MNIST-1D CNN, 10 interleaved repetitions, one thread, a loaded 2-core
machine): 488 ms in passes of 64 against 564 ms in one pass of 100 (the MLP within noise). The cohort is cut
into equal passes of clients with similar numbers of term examples (:meth:`CohortTrainer._hog_terms`), each
padded to its own widest client: the CNN's term 245 → 192–198 ms a cohort of 100 (MNIST-1D, Dirichlet 0.5: a
client's examples, at most 32, are 22 on average), the MLP's within noise."""


def unbatchable_model_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot train as a stacked cohort (None when it can).

    Buffers (BatchNorm's running statistics, say) are state that one batched
    forward cannot keep per client.
    """
    buffers = [name for name, _ in model.named_buffers()]
    if not buffers:
        return None
    return f"the model has buffers ({', '.join(buffers[:3])}), which one batch cannot keep per client"


@dataclass(frozen=True)
class CohortWork:
    """What the cohort's clients computed: rows in the order of the clients asked for.

    ``updates`` and ``terms`` are ``[K, P]`` on the CPU in the layout of the
    model's ``state_dict`` (its keys in order, each flattened); ``terms`` is
    None without ``hog``, and ``term_finite[k]`` says whether row k holds a
    finite term.
    """

    updates: torch.Tensor
    terms: torch.Tensor | None
    term_finite: list[bool]
    mean_losses: list[float]
    steps: list[int]
    third_order_seconds: float


class CohortTrainer:
    """Local training and third-order terms for any cohort of one population.

    Parameters
    ----------
    model : nn.Module
        The architecture (its parameters are replaced by the global model's on each call).
    x, y : np.ndarray
        The population's pooled training examples.
    client_indices : sequence of np.ndarray
        Client i's training examples are ``x[client_indices[i]]``.
    device : torch.device
        Where the data lives and the work runs.
    """

    def __init__(self, model: nn.Module, x: np.ndarray, y: np.ndarray, client_indices: tuple[np.ndarray, ...],
                 device: torch.device) -> None:
        reason = unbatchable_model_reason(model)
        if reason:
            raise ValueError(f"the vectorized engine cannot train this model: {reason} (use --engine inprocess)")
        self.model = model.to(device)
        self.shapes = {key: value.shape for key, value in model.state_dict().items()}
        self.keys = list(self.shapes)
        self.device = device
        self.use_data(x, y, client_indices)
        self._forward = vmap(lambda params, x: functional_call(self.model, params, (x,)))
        self._terms = vmap(self._third_order_term, in_dims=(None, 0, 0, 0, 0))
        self._program = _taylor_program(model)

    def use_data(self, x: np.ndarray, y: np.ndarray, client_indices: tuple[np.ndarray, ...]) -> None:
        """Train on these examples from now on (client i's are ``x[client_indices[i]]``), moved to the device once.

        A population too large to hold hands each block of clients its own (:mod:`fedhog.engines.shards`).
        """
        self.x = torch.as_tensor(x, device=self.device)
        self.y = torch.as_tensor(y, device=self.device)
        self.client_indices = client_indices

    # --- the per-client functions that vmap batches ------------------------------
    def _losses_and_gradients(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                              mask: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each client's minibatch loss and its gradient with respect to its own parameters.

        One batched forward (vmap over clients) and one backward of the sum of the clients' losses:
        client k's loss depends on its parameters only, so the gradient of the sum is each one's own.
        """
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        logits = self._forward(leaves, x)
        losses = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(mask)
        per_client = (losses * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)
        gradients = torch.autograd.grad(per_client.sum(), list(leaves.values()))
        return dict(zip(leaves, gradients, strict=True)), per_client.detach()

    def _client_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the unmasked examples (the per-client loop's minibatch loss)."""
        logits = functional_call(self.model, params, (x,))
        losses = nn.functional.cross_entropy(logits, y, reduction="none")
        return (losses * mask).sum() / mask.sum().clamp_min(1)

    def _third_order_terms(self, params: dict[str, torch.Tensor], directions: dict[str, torch.Tensor],
                           x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each client's t_k = ∇_θ(v_kᵀ∇²L_k(θ)v_k) at the shared ``params``, stacked ``[K, …]``, in one pass.

        Taylor mode (:mod:`fedhog.derivatives.taylor`, the client's own formulation) when the model has a
        Taylor program: the order-2 series of s ↦ L_k(θ + s·v_k), vmapped over the clients, gives
        c₂,k = ½ v_kᵀ∇²L_k v_k, and one reverse pass of Σ_k 2c₂,k through K views of θ gives every t_k
        (client k's coefficient depends on its own view only). Otherwise, or when an operation turns out to
        lack a rule, nested ``torch.func`` (:meth:`_third_order_term`, vmapped).
        """
        if self._program is not None:
            try:
                return self._taylor_terms(self._program, params, directions, x, y, mask)
            except Unsupported:
                self._program = None  # a rule is missing at run time (say, tanh-approximated GELU): not again
        return self._terms(params, directions, x, y, mask)

    def _taylor_terms(self, program: TaylorProgram, params: dict[str, torch.Tensor],
                      directions: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, torch.Tensor]:
        cohort = mask.shape[0]
        with torch.enable_grad():
            views = {k: v.detach().unsqueeze(0).expand(cohort, *v.shape).requires_grad_() for k, v in params.items()}

            def second_coefficient(p: dict[str, torch.Tensor], v: dict[str, torch.Tensor], x: torch.Tensor,
                                   y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
                return cross_entropy_series(program(p, {}, v, x, 3), y, 3, m)[2]

            total = 2 * vmap(second_coefficient)(views, directions, x, y, mask).sum()
            terms = torch.autograd.grad(total, list(views.values()), allow_unused=True)
        return {k: torch.zeros_like(v) if t is None else t for (k, v), t in zip(views.items(), terms, strict=True)}

    def _third_order_term(self, params: dict[str, torch.Tensor], direction: dict[str, torch.Tensor],
                          x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """t = ∇_θ(vᵀ∇²L(θ)v) of one client by nested ``torch.func``: reverse mode over the second directional
        derivative, itself forward over forward (vᵀ∇²L v = d²/ds² L(θ + s·v) at 0)."""
        def first_directional(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return jvp(lambda q: self._client_loss(q, x, y, mask), (p,), (direction,))[1]

        def second_directional(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return jvp(first_directional, (p,), (direction,))[1]

        return grad(second_directional)(params)

    # --- a round --------------------------------------------------------------------
    def train(self, global_state: dict[str, torch.Tensor], partitions: list[int], seeds: list[int], epochs: int,
              batch_size: int, learning_rate: float, momentum: float, hog: HogSettings | None = None) -> CohortWork:
        """Train every client of the cohort from ``global_state``; with ``hog``, also their third-order terms."""
        start = {k: v.to(self.device) for k, v in global_state.items()}
        cohort = len(partitions)
        index, mask, steps, first_orders = self._step_plan(partitions, seeds, epochs, batch_size)
        # Row r of the stacked parameters is client order[r]: most steps first, so the clients that take step s are
        # the first training[s] rows, a slice (every client starts from the same model: the order costs nothing).
        order = np.argsort(-steps, kind="stable")
        training = (steps[order][None, :] > np.arange(index.shape[0])[:, None]).sum(axis=1).tolist()
        rows = torch.as_tensor(order, device=self.device)
        index, mask = index[:, rows], mask[:, rows]
        params = {k: v.unsqueeze(0).expand(cohort, *v.shape).clone() for k, v in start.items()}
        velocity: dict[str, torch.Tensor] = {}
        total_loss = torch.zeros(cohort, dtype=torch.float64, device=self.device)
        for step, active in enumerate(training):
            gradients, loss = self._losses_and_gradients({k: v[:active] for k, v in params.items()},
                                                         self.x[index[step, :active]], self.y[index[step, :active]],
                                                         mask[step, :active])
            total_loss[:active] += loss.double()
            for key, gradient in gradients.items():
                if momentum > 0:  # torch.optim.SGD: v ← g on the first step, then v ← μ·v + g
                    if step == 0:
                        velocity[key] = gradient
                    else:
                        velocity[key][:active].mul_(momentum).add_(gradient)
                    gradient = velocity[key][:active]
                params[key][:active].add_(gradient, alpha=-learning_rate)  # torch.optim.SGD's own step
        back = torch.as_tensor(np.argsort(order), device=self.device)  # row of each client, in the order asked
        updates = torch.cat([(params[k] - start[k]).reshape(cohort, -1) for k in self.keys], dim=1)[back]
        client_steps = steps.tolist()
        mean_losses = (total_loss[back] / torch.as_tensor(steps, dtype=torch.float64, device=self.device)).tolist()
        terms, finite, seconds = None, [True] * cohort, 0.0
        if hog is not None:
            started = time.perf_counter()
            terms, finite = self._hog_terms(start, updates, first_orders, seeds, hog)
            if hog.mixing == "noise-aware":  # each client's λ_i ĝ_i (fedhog.privacy.noise_aware)
                scales = [local_step_scale(learning_rate, s, momentum) for s in client_steps]
                terms = terms * torch.tensor(scales, dtype=terms.dtype, device=terms.device)[:, None]
            seconds = time.perf_counter() - started
        return CohortWork(updates.detach().cpu(), None if terms is None else terms.cpu(), finite, mean_losses,
                          client_steps, seconds)

    def _step_plan(self, partitions: list[int], seeds: list[int], epochs: int,
                   batch_size: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, list[np.ndarray]]:
        """Example indices ``[S, K, B]``, their mask, how many steps (non-empty minibatches) client k takes, and
        each client's examples in its first epoch's order (its term's are the first of them: ``hog_rows``)."""
        plans, first_orders = [], []
        for partition, seed in zip(partitions, seeds, strict=True):
            own = self.client_indices[partition]
            orders = epoch_orders(len(own), max(epochs, 1), seed)  # local_batches' orders, drawn once
            first_orders.append(own[orders[0]])
            plans.append([own[batch] for epoch in minibatches(orders[:epochs], batch_size) for batch in epoch])
        steps = max(len(plan) for plan in plans)
        width = max(len(batch) for plan in plans for batch in plan)
        index = np.zeros((steps, len(plans), width), dtype=np.int64)
        mask = np.zeros((steps, len(plans), width), dtype=np.float32)
        for k, plan in enumerate(plans):
            for s, batch in enumerate(plan):
                index[s, k, :len(batch)] = batch
                mask[s, k, :len(batch)] = 1.0
        taken = np.array([sum(len(batch) > 0 for batch in plan) for plan in plans], dtype=np.int64)
        return (torch.as_tensor(index, device=self.device), torch.as_tensor(mask, device=self.device), taken,
                first_orders)

    def _hog_terms(self, start: dict[str, torch.Tensor], updates: torch.Tensor, first_orders: list[np.ndarray],
                   seeds: list[int], hog: HogSettings) -> tuple[torch.Tensor, list[bool]]:
        """Each client's third-order term (or its random control), flat ``[K, P]``, on the first
        ``hog.batch_size`` examples of its first epoch's order (:func:`~fedhog.training.hog_rows`).

        Noise-aware mixing: each client's Hutchinson estimate of ∇tr∇²L over ``hog.samples`` Rademacher
        directions from its seed (the ClientApp's :func:`~fedhog.client_app.noise_aware_estimate`), and its random
        control an isotropic direction of the estimate's norm."""
        names = [name for name, _ in self.model.named_parameters()]
        like = {k: start[k] for k in names}
        compute = self._third_order_terms
        if hog.term == "random" and hog.mixing == "random-sign":
            controls = [flatten({**like, **random_direction(like, control_term_seed(seed))}, self.keys)
                        for seed in seeds]
            return torch.stack(controls), [True] * len(seeds)
        if hog.mixing == "noise-aware":
            compute = self._trace_gradient_terms
            drawn = [hutchinson_directions(like, hog.samples, "rademacher", torch.Generator().manual_seed(seed))
                     for seed in seeds]
            stacked_directions = {n: torch.stack([d[n] for d in drawn]) for n in names}  # [K, samples, ...]
        elif hog.direction == "random":
            stacked_directions = random_directions(like, seeds)  # like is on self.device
        else:
            own = [self.unflatten(updates[k]) for k in range(len(seeds))]
            units = unit_directions([{n: update[n] for n in names} for update in own])  # one sync, not one a client
            directions = [unit if unit is not None else random_direction(like, seed)
                          for unit, seed in zip(units, seeds, strict=True)]
            stacked_directions = {n: torch.stack([d[n] for d in directions]) for n in names}
        rows = [order[:hog.batch_size] for order in first_orders]
        flat: torch.Tensor | None = None
        for clients in self._term_passes([len(r) for r in rows]):
            members = clients.tolist()  # positions as ints: the loops below read no tensor element
            width = max(len(rows[k]) for k in members)
            index = np.zeros((len(members), width), dtype=np.int64)
            mask = np.zeros((len(members), width), dtype=np.float32)
            for j, k in enumerate(members):
                index[j, :len(rows[k])], mask[j, :len(rows[k])] = rows[k], 1.0
            index_t = torch.as_tensor(index, device=self.device)
            on_device = clients.to(self.device)
            terms = compute(like, {n: d[on_device] for n, d in stacked_directions.items()},
                            self.x[index_t], self.y[index_t], torch.as_tensor(mask, device=self.device))
            block = torch.cat([terms[k].reshape(len(members), -1) for k in self.keys], dim=1).detach()
            if flat is None:
                flat = block.new_empty(len(rows), block.shape[1])
            flat[on_device] = block
        assert flat is not None  # a cohort has clients
        if hog.term == "random":  # noise-aware's control: the estimate's norm, an isotropic direction
            norms = torch.linalg.vector_norm(flat.double(), dim=1)
            isotropic = torch.stack([flatten({**like, **random_direction(like, control_term_seed(seed))}, self.keys)
                                     for seed in seeds])
            flat = (isotropic.double() * norms[:, None]).to(flat.dtype)
        return flat, torch.isfinite(flat).all(dim=1).tolist()

    def _trace_gradient_terms(self, params: dict[str, torch.Tensor], directions: dict[str, torch.Tensor],
                              x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each client's mean_j ∇_θ(v_kjᵀ∇²L_k v_kj) over its directions ``[K, samples, …]``, stacked ``[K, …]``.

        One direction: :meth:`_third_order_terms`. More: the order-2 series vmapped over each client's directions
        inside the vmap over clients (Taylor mode, one reverse pass through K views of θ), or nested ``torch.func``.
        """
        if next(iter(directions.values())).shape[1] == 1:
            return self._third_order_terms(params, {n: d[:, 0] for n, d in directions.items()}, x, y, mask)
        if self._program is not None:
            try:
                return self._taylor_trace_terms(self._program, params, directions, x, y, mask)
            except Unsupported:
                self._program = None
        return vmap(lambda v, x, y, m: {n: t.mean(0) for n, t in vmap(
            lambda u: self._third_order_term(params, u, x, y, m))(v).items()})(directions, x, y, mask)

    def _taylor_trace_terms(self, program: TaylorProgram, params: dict[str, torch.Tensor],
                            directions: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                            mask: torch.Tensor) -> dict[str, torch.Tensor]:
        cohort = mask.shape[0]
        with torch.enable_grad():
            views = {k: v.detach().unsqueeze(0).expand(cohort, *v.shape).requires_grad_() for k, v in params.items()}

            def client_forms(p: dict[str, torch.Tensor], vs: dict[str, torch.Tensor], x: torch.Tensor,
                             y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
                return vmap(lambda v: cross_entropy_series(program(p, {}, v, x, 3), y, 3, m)[2])(vs).mean()

            total = 2 * vmap(client_forms)(views, directions, x, y, mask).sum()
            terms = torch.autograd.grad(total, list(views.values()), allow_unused=True)
        return {k: torch.zeros_like(v) if t is None else t for (k, v), t in zip(views.items(), terms, strict=True)}

    @staticmethod
    def _term_passes(examples: list[int]) -> list[torch.Tensor]:
        """The cohort's clients (positions) in passes of at most :data:`TERM_CLIENTS_PER_PASS`, as few as that
        allows and of equal size, each of clients with similar numbers of term examples (most first): a pass is
        padded to its widest client, so this pads little. Depends on ``examples`` alone (the same passes, and
        bits, however the cohort is sharded)."""
        order = np.argsort(-np.asarray(examples), kind="stable")
        passes = -(-len(examples) // TERM_CLIENTS_PER_PASS)
        return [torch.as_tensor(part) for part in np.array_split(order, passes)]

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A flat ``[P]`` row (the layout of ``updates`` and ``terms``) as the model's named tensors."""
        return unflatten(flat, self.shapes)


@dataclass(frozen=True)
class HogSettings:
    """How clients compute their third-order terms (``hog-direction``, ``hog-term``, ``hog-batch-size``,
    ``hog-mixing``, ``noise-aware-samples``)."""

    direction: str
    term: str
    batch_size: int
    mixing: str = "random-sign"
    samples: int = 1


def _taylor_program(model: nn.Module) -> TaylorProgram | None:
    """The model's Taylor program, or None when some operation has no Taylor rule."""
    try:
        return program_for(model)
    except Unsupported:
        return None
