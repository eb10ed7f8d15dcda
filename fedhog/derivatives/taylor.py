"""Taylor-mode propagation of ``s ↦ L(θ + s v)`` through a ``torch.fx``-traced model.

The model is traced once; each value in the graph becomes either a constant
tensor (independent of ``s``) or a :class:`Jet` of normalised Taylor
coefficients.  Parameters enter as the order-1 jets ``(θ, v)``; bilinear layers
(linear, convolution, matmul) sum their coefficient pairs (Leibniz rule),
activations use the series recurrences of :mod:`.series`, and piecewise-linear
ones (ReLU, max-pooling) are exact away from their kinks.  An operation without
a rule raises :class:`Unsupported` so the caller can fall back to nested
``torch.func``.
"""

from __future__ import annotations

import builtins
import operator
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from . import series
from .api import eval_mode

Params = dict[str, Tensor]


class Unsupported(Exception):
    """The model or loss uses an operation without a Taylor-mode rule."""


class Jet:
    """Truncated Taylor series ``Σ cₖ sᵏ`` of a tensor; missing trailing coefficients are zero."""

    __slots__ = ("coeffs",)

    def __init__(self, coeffs: Sequence[Tensor]) -> None:
        self.coeffs = tuple(coeffs)

    @property
    def primal(self) -> Tensor:
        return self.coeffs[0]


def _series(a: Jet | Tensor) -> tuple[Tensor, ...]:
    return a.coeffs if isinstance(a, Jet) else (a,)


def _wrap(coeffs: Sequence[Tensor]) -> Jet | Tensor:
    return Jet(coeffs) if len(coeffs) > 1 else coeffs[0]


def _has_jet(args: Any) -> bool:
    if isinstance(args, Jet):
        return True
    if isinstance(args, (list, tuple)):
        return any(_has_jet(a) for a in args)
    if isinstance(args, dict):
        return any(_has_jet(a) for a in args.values())
    return False


def _max_len(args: Any) -> int:
    if isinstance(args, Jet):
        return len(args.coeffs)
    if isinstance(args, (list, tuple)):
        return max((_max_len(a) for a in args), default=1)
    if isinstance(args, dict):
        return max((_max_len(a) for a in args.values()), default=1)
    return 1


def _substitute(a: Any, k: int, zero_consts: bool) -> Any:
    if isinstance(a, Jet):
        return a.coeffs[k] if k < len(a.coeffs) else torch.zeros_like(a.primal)
    if isinstance(a, Tensor):
        return torch.zeros_like(a) if zero_consts and k > 0 else a
    if isinstance(a, (list, tuple)):
        return type(a)(_substitute(x, k, zero_consts) for x in a)
    if isinstance(a, dict):
        return {key: _substitute(x, k, zero_consts) for key, x in a.items()}
    return a


def per_coefficient(f: Callable[..., Tensor], args: tuple, kwargs: dict, zero_consts: bool) -> Jet | Tensor:
    """Apply an operation that is linear in its jet arguments coefficient by coefficient.

    ``zero_consts`` marks operations that are affine in their tensor arguments
    (add, cat, …): constant tensors then only enter coefficient 0.
    """
    out = [
        f(*_substitute(args, k, zero_consts), **_substitute(kwargs, k, zero_consts))
        for k in range(_max_len((args, kwargs)))
    ]
    return _wrap(out)


def bilinear(op: Callable[[Tensor, Tensor], Tensor], x: Jet | Tensor, w: Jet | Tensor, n: int) -> Jet | Tensor:
    """``(x·w)_k = Σ_{i+j=k} op(x_i, w_j)`` for an operation linear in each argument.

    One call per coefficient pair: batching coefficients into one call would need
    a stacked copy of ``x`` that the reverse pass keeps alive as well, and costs
    more time than it saves on the benchmark models.
    """
    xs, ws = _series(x), _series(w)
    n_out = min(n, len(xs) + len(ws) - 1)
    terms: list[list[Tensor]] = [[] for _ in range(n_out)]
    for j, wj in enumerate(ws[:n_out]):
        for i in range(min(len(xs), n_out - j)):
            terms[i + j].append(op(xs[i], wj))
    return _wrap([sum(t[1:], t[0]) for t in terms])


def _mul(a: Any, b: Any, n: int) -> Any:
    if isinstance(a, Jet) and isinstance(b, Jet):
        return Jet(series.mul(a.coeffs, b.coeffs, n))
    return per_coefficient(operator.mul, (a, b), {}, zero_consts=False)


def _div(a: Any, b: Any, n: int) -> Any:
    if isinstance(b, Jet):
        return _mul(a, Jet(series.reciprocal(b.coeffs, n)), n)
    return per_coefficient(operator.truediv, (a, b), {}, zero_consts=False)


def _unary(fn: Callable[..., tuple[Tensor, ...]], x: Any, n: int, *extra: Any) -> Any:
    """Apply a series function to a jet, or its value part to a constant."""
    return _wrap(fn(x.coeffs, n, *extra)) if isinstance(x, Jet) else fn((x,), 1, *extra)[0]


def _fold_bias(op: Callable[..., Tensor], x: Any, w: Any, b: Any, n: int) -> Any:
    """``op(x, w, b)`` for a bilinear layer with bias; a constant ``x`` takes each bias coefficient into its call."""
    ws, bs = _series(w), _series(b) if b is not None else ()
    if not isinstance(x, Jet) and len(bs) <= len(ws):
        return _wrap([op(x, wj, bs[j] if j < len(bs) else None) for j, wj in enumerate(ws[:n])])
    y = bilinear(lambda xi, wj: op(xi, wj, None), x, w, n)
    return y if b is None else _add(y, b)


def _linear_rule(n: int, x: Any, w: Any, b: Any = None) -> Any:
    return _fold_bias(F.linear, x, w, b, n)


def _add(a: Any, b: Any, sign: float = 1.0) -> Any:
    """``a + sign·b`` coefficient by coefficient; constants and numbers only enter ``c₀``."""
    sa, sb = _series(a), _series(b) if isinstance(b, (Tensor, Jet)) else (b,)
    out = [sa[0] + sb[0] if sign == 1.0 else sa[0] - sb[0]]
    shape = out[0].shape
    for k in range(1, max(len(sa), len(sb))):
        if k < len(sa) and k < len(sb):
            out.append(sa[k] + sb[k] if sign == 1.0 else sa[k] - sb[k])
        else:
            c = sa[k] if k < len(sa) else (sb[k] if sign == 1.0 else -sb[k])
            out.append(c if c.shape == shape else c.expand(shape))
    return _wrap(out)


def _conv_rule(conv: Callable[..., Tensor]) -> Callable[..., Any]:
    def rule(n: int, x: Any, w: Any, b: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, Jet) and b is not None:  # broadcast the bias over the spatial dimensions
            shape = (-1,) + (1,) * (x.primal.dim() - 2)
            b = per_coefficient(lambda t: t.view(shape), (b,), {}, zero_consts=False)
        return _fold_bias(lambda xi, wj, bj: conv(xi, wj, bj, *args, **kwargs), x, w, b, n)

    return rule


_SMOOTH: dict[Any, Callable[[tuple[Tensor, ...], int], tuple[Tensor, ...]]] = {
    torch.tanh: series.tanh,
    F.tanh: series.tanh,
    "tanh": series.tanh,
    torch.sigmoid: series.sigmoid,
    F.sigmoid: series.sigmoid,
    "sigmoid": series.sigmoid,
    torch.relu: series.relu,
    F.relu: series.relu,
    "relu": series.relu,
    torch.exp: series.exp,
    "exp": series.exp,
    torch.log: series.log,
    "log": series.log,
}

_LINEAR_OPS = {  # linear in their jet arguments, other tensors multiply
    "view",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "unsqueeze",
    "squeeze",
    "contiguous",
    "mean",
    "sum",
    "expand",
    "t",
    torch.flatten,
    torch.reshape,
    torch.mean,
    torch.sum,
    torch.transpose,
    torch.permute,
    torch.unsqueeze,
    torch.squeeze,
    operator.getitem,
    operator.neg,
    torch.neg,
    "neg",
    F.avg_pool1d,
    F.avg_pool2d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
}
_ADD_SUB = {operator.add, operator.sub, torch.add, torch.sub, "add", "sub"}
_AFFINE_OPS = _ADD_SUB | {torch.cat, torch.stack}
_PRIMAL_OPS = {"size", "dim", builtins.getattr}


def _call(target: Any, n: int, args: tuple, kwargs: dict) -> Any:
    """Apply a ``call_function``/``call_method`` target to jets and constants."""
    if not _has_jet((args, kwargs)):
        f = getattr(args[0], target) if isinstance(target, str) else target
        return f(*(args[1:] if isinstance(target, str) else args), **kwargs)
    if target in _PRIMAL_OPS:
        return _call(target, n, _substitute(args, 0, False), _substitute(kwargs, 0, False))
    method = isinstance(target, str)
    f: Callable[..., Any] = (lambda obj, *a, **k: getattr(obj, target)(*a, **k)) if method else target
    if target in _SMOOTH:
        if kwargs or len(args) != 1:
            raise Unsupported(f"{target} with extra arguments")
        return _unary(_SMOOTH[target], args[0], n)
    if target is F.gelu:
        if kwargs.get("approximate", "none") != "none":
            raise Unsupported("tanh-approximated GELU")
        return _unary(series.gelu, args[0], n)
    if target is F.softplus:
        return _softplus(n, args[0], *args[1:], **kwargs)
    if target is F.leaky_relu:
        slope = kwargs.get("negative_slope", args[1] if len(args) > 1 else 0.01)
        return _unary(series.leaky_relu, args[0], n, slope)
    if target in _LINEAR_OPS:
        return per_coefficient(f, args, kwargs, zero_consts=False)
    if target in _ADD_SUB and len(args) == 2 and not kwargs:
        a, b = args
        sign = -1.0 if target in (operator.sub, torch.sub, "sub") else 1.0
        if isinstance(a, Jet):
            return _add(a, b, sign)
        return _add(b if sign == 1.0 else _call(operator.neg, n, (b,), {}), a)
    if target in _AFFINE_OPS:
        like = next(a for a in args if isinstance(a, Jet)).primal if target in _ADD_SUB else None
        args = tuple(like.new_tensor(a) if like is not None and isinstance(a, (int, float)) else a for a in args)
        return per_coefficient(f, args, kwargs, zero_consts=True)
    if target in (operator.mul, torch.mul, "mul") and not kwargs:
        return _mul(args[0], args[1], n)
    if target in (operator.truediv, torch.div, "div") and not kwargs:
        return _div(args[0], args[1], n)
    if target in (operator.matmul, torch.matmul, "matmul"):
        return bilinear(torch.matmul, args[0], args[1], n)
    if target is F.linear:
        return _linear_rule(n, *args, **kwargs)
    if target in (F.conv1d, F.conv2d):
        return _conv_rule(target)(n, *args, **kwargs)
    raise Unsupported(f"no Taylor rule for {target}")


def _softplus(n: int, x: Any, beta: float = 1.0, threshold: float = 20.0) -> Any:
    """Softplus; the linear regime past ``threshold`` differs from log(1+eᶻ) by < e⁻²⁰."""
    if beta == 1.0:
        return _unary(series.softplus, x, n)
    return _call(operator.truediv, n, (_unary(series.softplus, _call(operator.mul, n, (x, beta), {}), n), beta), {})


def _batchnorm(n: int, m: nn.Module, x: Any, w: Any, b: Any) -> Any:
    if m.running_mean is None or m.running_var is None:
        raise Unsupported("BatchNorm without running statistics")
    shape = (-1,) + (1,) * (_series(x)[0].dim() - 2)
    inv_std = torch.rsqrt(m.running_var + m.eps).view(shape)
    y = per_coefficient(
        operator.mul, (per_coefficient(operator.sub, (x, m.running_mean.view(shape)), {}, True), inv_std), {}, False
    )
    if w is not None:
        y = _mul(y, per_coefficient(lambda t: t.view(shape), (w,), {}, False), n)
    if b is not None:
        y = _add(y, per_coefficient(lambda t: t.view(shape), (b,), {}, False))
    return y


def _max_pool(m: nn.Module, x: Any) -> Any:
    """Max-pooling: every coefficient is taken where the value part attains the maximum."""
    if not isinstance(x, Jet):
        return m(x)
    pool = F.max_pool1d if isinstance(m, nn.MaxPool1d) else F.max_pool2d
    y0, idx = pool(x.primal, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, return_indices=True)
    flat_idx = idx.flatten(2)
    rest = [c.flatten(2).gather(2, flat_idx).view_as(y0) for c in x.coeffs[1:]]
    return Jet([y0, *rest])


def _module_rule(m: nn.Module) -> Callable[..., Any] | None:
    """Return ``rule(n, x, weight, bias)`` for a leaf module, or ``None`` if unsupported."""
    t = type(m)
    if t is nn.Linear:
        return lambda n, x, w, b: _linear_rule(n, x, w, b)
    if t in (nn.Conv1d, nn.Conv2d):
        if m.padding_mode != "zeros":
            return None
        conv = F.conv1d if t is nn.Conv1d else F.conv2d
        return lambda n, x, w, b: _conv_rule(conv)(n, x, w, b, m.stride, m.padding, m.dilation, m.groups)
    smooth = {nn.Tanh: series.tanh, nn.Sigmoid: series.sigmoid, nn.ReLU: series.relu}
    if t in smooth:
        return lambda n, x, w, b: _unary(smooth[t], x, n)
    if t is nn.GELU and m.approximate == "none":
        return lambda n, x, w, b: _unary(series.gelu, x, n)
    if t is nn.Softplus:
        return lambda n, x, w, b: _softplus(n, x, m.beta, m.threshold)
    if t is nn.LeakyReLU:
        return lambda n, x, w, b: _unary(series.leaky_relu, x, n, m.negative_slope)
    if t in (nn.Identity, nn.Dropout):
        return lambda n, x, w, b: x
    if t is nn.Flatten:
        return lambda n, x, w, b: per_coefficient(lambda c: c.flatten(m.start_dim, m.end_dim), (x,), {}, False)
    if t in (nn.MaxPool1d, nn.MaxPool2d):
        return lambda n, x, w, b: _max_pool(m, x)
    if t in (nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d):
        return lambda n, x, w, b: per_coefficient(m, (x,), {}, False)
    if t in (nn.BatchNorm1d, nn.BatchNorm2d) and m.track_running_stats:
        return lambda n, x, w, b: _batchnorm(n, m, x, w, b)
    return None


def _function_supported(target: Any) -> bool:
    known = set(_SMOOTH) | _LINEAR_OPS | _AFFINE_OPS | _PRIMAL_OPS
    known |= {F.gelu, F.softplus, F.leaky_relu, F.linear, F.conv1d, F.conv2d}
    known |= {operator.mul, torch.mul, "mul", operator.truediv, torch.div, "div"}
    known |= {operator.matmul, torch.matmul, "matmul"}
    try:
        return target in known
    except TypeError:
        return False


class TaylorProgram:
    """A model traced with ``torch.fx`` whose every node has a Taylor rule.

    Raises
    ------
    Unsupported
        If tracing fails or a node has no rule.
    """

    def __init__(self, model: nn.Module) -> None:
        try:
            with eval_mode(model):
                self.graph_module = torch.fx.symbolic_trace(model)
        except Exception as exc:  # fx raises many kinds of errors on untraceable code
            raise Unsupported(f"torch.fx could not trace the model: {exc}") from exc
        self.rules: dict[str, Callable[..., Any]] = {}
        placeholders = 0
        for node in self.graph_module.graph.nodes:
            if node.op == "placeholder":
                placeholders += 1
            elif node.op == "call_module":
                rule = _module_rule(self.graph_module.get_submodule(node.target))
                if rule is None:
                    raise Unsupported(f"no Taylor rule for module {node.target!r}")
                self.rules[node.target] = rule
            elif node.op in ("call_function", "call_method") and not _function_supported(node.target):
                raise Unsupported(f"no Taylor rule for {node.target}")
        if placeholders != 1:
            raise Unsupported("Taylor mode supports models with exactly one input")

    def __call__(self, params: Params, buffers: Params, direction: Params, inputs: Tensor, n: int) -> Jet | Tensor:
        """Return the first ``n`` Taylor coefficients of ``model(inputs; θ + s v)``."""
        env: dict[torch.fx.Node, Any] = {}

        def tensor(name: str) -> Any:
            if name in params:
                return Jet((params[name], direction[name]))
            if name in buffers:
                return buffers[name]
            obj: Any = self.graph_module
            for part in name.split("."):
                obj = getattr(obj, part, None)
            return obj

        def load(a: Any) -> Any:
            return torch.fx.node.map_arg(a, lambda node: env[node])

        for node in self.graph_module.graph.nodes:
            if node.op == "placeholder":
                env[node] = inputs
            elif node.op == "get_attr":
                env[node] = tensor(node.target)
            elif node.op == "call_module":
                prefix = node.target + "."
                x = load(node.args)[0]
                env[node] = self.rules[node.target](n, x, tensor(prefix + "weight"), tensor(prefix + "bias"))
            elif node.op in ("call_function", "call_method"):
                env[node] = _call(node.target, n, load(node.args), load(node.kwargs))
            elif node.op == "output":
                return load(node.args)[0]
        raise Unsupported("graph without output")


_PROGRAMS: "weakref.WeakKeyDictionary[nn.Module, TaylorProgram | Unsupported]" = weakref.WeakKeyDictionary()


def program_for(model: nn.Module) -> TaylorProgram:
    """Return the cached :class:`TaylorProgram` of ``model``; raises :class:`Unsupported`."""
    cached = _PROGRAMS.get(model)
    if cached is None:
        try:
            cached = TaylorProgram(model)
        except Unsupported as exc:
            cached = exc
        _PROGRAMS[model] = cached
    if isinstance(cached, Unsupported):
        raise cached
    return cached


def cross_entropy_series(logits: Jet | Tensor, targets: Tensor, n: int) -> Tensor:
    """Coefficients ``[n]`` of the mean softmax cross-entropy along ``s``.

    Up to order 2 the log-sum-exp coefficients are softmax moments
    (``E_p z₁``, ``E_p z₂ + Var_p(z₁)/2``); beyond, exp/log series recurrences.
    """
    z = _series(logits)
    idx = targets.long().unsqueeze(-1)
    picked = [(z[k].gather(-1, idx).squeeze(-1) if k < len(z) else None) for k in range(n)]
    if n <= 3:
        lse0 = torch.logsumexp(z[0], dim=-1)
        coeffs = [(lse0 - picked[0]).mean()]
        if n > 1:
            p = torch.exp(z[0] - lse0.unsqueeze(-1))
            pz1 = p * z[1] if len(z) > 1 else torch.zeros_like(p)
            m1 = pz1.sum(-1)
            coeffs.append((m1 - picked[1]).mean() if len(z) > 1 else m1.mean())
        if n > 2:
            c2 = 0.5 * ((pz1 * z[1]).sum(-1) - m1 * m1) if len(z) > 1 else torch.zeros_like(m1)
            if len(z) > 2:
                c2 = c2 + (p * z[2]).sum(-1) - picked[2]
            coeffs.append(c2.mean())
        return torch.stack(coeffs)
    shift = z[0].detach().amax(dim=-1, keepdim=True)
    e = series.exp((z[0] - shift,) + z[1:], n)
    lse = series.log(tuple(c.sum(-1) for c in e), n)
    coeffs = [(lse[k] - picked[k]).mean() if picked[k] is not None else lse[k].mean() for k in range(n)]
    coeffs[0] = coeffs[0] + shift.mean()
    return torch.stack(coeffs)


def mse_series(outputs: Jet | Tensor, targets: Tensor, n: int) -> Tensor:
    """Coefficients ``[n]`` of the mean squared error along ``s``."""
    r = _series(outputs)
    sq = series.square((r[0] - targets,) + r[1:], n)
    coeffs = [c.mean() for c in sq] + [torch.zeros_like(sq[0].mean())] * (n - len(sq))
    return torch.stack(coeffs)


LOSS_SERIES = {"cross_entropy": cross_entropy_series, "mse": mse_series}


def loss_series(
    program: TaylorProgram,
    loss: str,
    params: Params,
    buffers: Params,
    direction: Params,
    inputs: Tensor,
    targets: Tensor,
    n: int,
) -> Tensor:
    """Normalised Taylor coefficients ``[n]`` of ``s ↦ L(θ + s v)``: ``c_k = L⁽ᵏ⁾(0)/k!``."""
    return LOSS_SERIES[loss](program(params, buffers, direction, inputs, n), targets, n)
