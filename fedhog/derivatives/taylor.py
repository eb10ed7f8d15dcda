"""Taylor-mode propagation of ``s ↦ L(θ + s v)`` through a ``torch.fx``-traced model.

The model is traced once; each value in the graph becomes either a constant
tensor (independent of ``s``) or a :class:`Jet` of normalised Taylor
coefficients.  Parameters enter as the order-1 jets ``(θ, v)``; bilinear layers
(linear, convolution, matmul) sum their coefficient pairs (Leibniz rule),
activations use the series recurrences of :mod:`.series`, and piecewise-linear
ones (ReLU, max-pooling) are exact away from their kinks, and the
normalisation layers (LayerNorm, GroupNorm, RMSNorm, eval-mode BatchNorm) are
written as mean/variance/``rsqrt`` series, never through PyTorch's fused
kernels (whose higher-order derivatives are wrong, see :mod:`.trusted`).  A
parameter shared by several layers (tied weights) enters as the same jet at
every use.  An operation without a rule raises :class:`Unsupported` so the
caller can fall back to nested ``torch.func``.
"""

from __future__ import annotations

import builtins
import inspect
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from . import products, series, trusted
from .api import eval_mode
from .errors import Unsupported

Params = dict[str, Tensor]


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

    Products as in :func:`.products.series_product` (Karatsuba pairs for large layers).
    """
    return _wrap(products.series_product(op, _series(x), _series(w), n))


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
    xs, ws = _series(x), _series(w)
    if products.karatsuba_linear_applies(xs, ws, n):
        y = _wrap(products.karatsuba_linear(xs, ws[0], ws[1]))
        return y if b is None else _add(y, b)
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


def _rsqrt(u: tuple[Tensor, ...], n: int) -> tuple[Tensor, ...]:
    """``1/√u`` (weight standardisation, hand-written normalisations)."""
    return series.power(u, n, -0.5)


_SMOOTH: dict[Any, Callable[[tuple[Tensor, ...], int], tuple[Tensor, ...]]] = {
    torch.tanh: series.tanh,
    F.tanh: series.tanh,
    "tanh": series.tanh,
    torch.sigmoid: series.sigmoid,
    F.sigmoid: series.sigmoid,
    "sigmoid": series.sigmoid,
    F.silu: series.silu,
    "silu": series.silu,
    torch.relu: series.relu,
    F.relu: series.relu,
    "relu": series.relu,
    torch.exp: series.exp,
    "exp": series.exp,
    torch.log: series.log,
    "log": series.log,
    torch.rsqrt: _rsqrt,
    "rsqrt": _rsqrt,
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
        plain = getattr(args[0], target) if isinstance(target, str) else target
        return plain(*(args[1:] if isinstance(target, str) else args), **kwargs)
    if target in _PRIMAL_OPS:
        return _call(target, n, _substitute(args, 0, False), _substitute(kwargs, 0, False))
    method = isinstance(target, str)
    f: Callable[..., Any] = (lambda obj, *a, **k: getattr(obj, target)(*a, **k)) if method else target
    if target in _SMOOTH:
        inplace = kwargs.get("inplace", args[1] if len(args) == 2 else False)
        if set(kwargs) - {"inplace"} or len(args) > 2 or inplace is not False:
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
    if target in _NORM_FUNCTIONS:
        return _norm_call(target, n, args, kwargs)
    raise Unsupported(f"no Taylor rule for {target}")


def _softplus(n: int, x: Any, beta: float = 1.0, threshold: float = 20.0) -> Any:
    """Softplus; the linear regime past ``threshold`` differs from log(1+eᶻ) by < e⁻²⁰."""
    if beta == 1.0:
        return _unary(series.softplus, x, n)
    return _call(operator.truediv, n, (_unary(series.softplus, _call(operator.mul, n, (x, beta), {}), n), beta), {})


def _batchnorm(n: int, m: nn.BatchNorm1d | nn.BatchNorm2d, x: Any, w: Any, b: Any) -> Any:
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


def _reshaped(x: Any, shape: tuple[int, ...]) -> Any:
    return per_coefficient(lambda t: t.reshape(shape), (x,), {}, False)


def _affine(n: int, y: Any, w: Any, b: Any, shape: tuple[int, ...]) -> Any:
    """``y · w + b`` with ``w`` and ``b`` reshaped to ``shape`` (either may be ``None``)."""
    if w is not None:
        y = _mul(y, _reshaped(w, shape), n)
    if b is not None:
        y = _add(y, _reshaped(b, shape))
    return y


def _normalize(n: int, x: Any, dims: tuple[int, ...], eps: float) -> Any:
    """Series of ``(x − mean) · rsqrt(var + eps)`` over ``dims``: mean, square, mean, power −½, product."""
    if not isinstance(x, Jet):
        return trusted.normalize(x, dims, eps)
    d = tuple(c - c.mean(dims, keepdim=True) for c in x.coeffs)
    var = [c.mean(dims, keepdim=True) for c in series.square(d, n)]
    var[0] = var[0] + eps
    return Jet(series.mul(d, series.power(tuple(var), n, -0.5), n))


def _trailing(normalized_shape: Any) -> int:
    return 1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))


def _layer_norm(n: int, x: Any, normalized_shape: Any, w: Any = None, b: Any = None, eps: float = 1e-5) -> Any:
    k = _trailing(normalized_shape)
    xp = _series(x)[0]
    y = _normalize(n, x, tuple(range(-k, 0)), eps)
    return _affine(n, y, w, b, tuple(xp.shape[xp.dim() - k :]))


def _group_norm(n: int, x: Any, num_groups: int, w: Any = None, b: Any = None, eps: float = 1e-5) -> Any:
    xp = _series(x)[0]
    grouped = _reshaped(x, (xp.shape[0], num_groups, -1))
    y = _reshaped(_normalize(n, grouped, (-1,), eps), tuple(xp.shape))
    return _affine(n, y, w, b, trusted.channel_shape(xp))


def _rms_norm(n: int, x: Any, normalized_shape: Any, w: Any = None, eps: float | None = None) -> Any:
    k = _trailing(normalized_shape)
    xp = _series(x)[0]
    dims = tuple(range(-k, 0))
    eps = torch.finfo(xp.dtype).eps if eps is None else eps
    if isinstance(x, Jet):
        ms = [c.mean(dims, keepdim=True) for c in series.square(x.coeffs, n)]
        ms[0] = ms[0] + eps
        y: Any = Jet(series.mul(x.coeffs, series.power(tuple(ms), n, -0.5), n))
    else:
        y = x * torch.rsqrt((x * x).mean(dims, keepdim=True) + eps)
    return _affine(n, y, w, None, tuple(xp.shape[xp.dim() - k :]))


def _bound(signature_of: Callable[..., Any], names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of a call by name (``names`` in positional order for builtins without a signature)."""
    try:
        return dict(inspect.signature(signature_of).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        out = dict(zip(names, args, strict=False))
        out.update(kwargs)
        return out


_LN_ARGS = ("input", "normalized_shape", "weight", "bias", "eps")
_GN_ARGS = ("input", "num_groups", "weight", "bias", "eps")
_RMS_ARGS = ("input", "normalized_shape", "weight", "eps")


def _norm_call(target: Any, n: int, args: tuple, kwargs: dict) -> Any:
    """``F.layer_norm``/``torch.layer_norm``, ``F.group_norm``, ``F.rms_norm`` as series."""
    if target in (F.layer_norm, torch.layer_norm):
        a = _bound(F.layer_norm, _LN_ARGS, args[:5], {k: v for k, v in kwargs.items() if k != "cudnn_enable"})
        return _layer_norm(n, a["input"], a["normalized_shape"], a.get("weight"), a.get("bias"), a.get("eps", 1e-5))
    if target is F.group_norm:
        a = _bound(F.group_norm, _GN_ARGS, args, kwargs)
        return _group_norm(n, a["input"], a["num_groups"], a.get("weight"), a.get("bias"), a.get("eps", 1e-5))
    a = _bound(F.rms_norm, _RMS_ARGS, args, kwargs)
    return _rms_norm(n, a["input"], a["normalized_shape"], a.get("weight"), a.get("eps"))


_NORM_FUNCTIONS = {F.layer_norm, torch.layer_norm, F.group_norm, F.rms_norm}


def _max_pool(m: nn.MaxPool1d | nn.MaxPool2d, x: Any) -> Any:
    """Max-pooling: every coefficient is taken where the value part attains the maximum."""
    if not isinstance(x, Jet):
        return m(x)
    pool = F.max_pool1d if isinstance(m, nn.MaxPool1d) else F.max_pool2d
    y0, idx = pool(x.primal, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, return_indices=True)
    flat_idx = idx.flatten(2)
    rest = [c.flatten(2).gather(2, flat_idx).view_as(y0) for c in x.coeffs[1:]]
    return Jet([y0, *rest])


def _module_rule(m: nn.Module) -> Callable[..., Any] | None:
    """Return ``rule(n, x, weight, bias)`` for a leaf module, or ``None`` if unsupported.

    Types are matched exactly (a subclass may compute something else); ``type(m) is`` also types the attributes read.
    """
    t = type(m)
    if type(m) is nn.Linear:
        return lambda n, x, w, b: _linear_rule(n, x, w, b)
    if type(m) is nn.Conv1d or type(m) is nn.Conv2d:
        if m.padding_mode != "zeros":
            return None
        conv = F.conv1d if type(m) is nn.Conv1d else F.conv2d
        return lambda n, x, w, b: _conv_rule(conv)(n, x, w, b, m.stride, m.padding, m.dilation, m.groups)
    smooth = {nn.Tanh: series.tanh, nn.Sigmoid: series.sigmoid, nn.SiLU: series.silu, nn.ReLU: series.relu}
    if t in smooth:
        return lambda n, x, w, b: _unary(smooth[t], x, n)
    if type(m) is nn.GELU and m.approximate == "none":
        return lambda n, x, w, b: _unary(series.gelu, x, n)
    if type(m) is nn.Softplus:
        return lambda n, x, w, b: _softplus(n, x, m.beta, m.threshold)
    if type(m) is nn.LeakyReLU:
        return lambda n, x, w, b: _unary(series.leaky_relu, x, n, m.negative_slope)
    if t in (nn.Identity, nn.Dropout):
        return lambda n, x, w, b: x
    if type(m) is nn.Flatten:
        return lambda n, x, w, b: per_coefficient(lambda c: c.flatten(m.start_dim, m.end_dim), (x,), {}, False)
    if type(m) is nn.MaxPool1d or type(m) is nn.MaxPool2d:
        return lambda n, x, w, b: _max_pool(m, x)
    if t in (nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d):
        return lambda n, x, w, b: per_coefficient(m, (x,), {}, False)
    if (type(m) is nn.BatchNorm1d or type(m) is nn.BatchNorm2d) and m.track_running_stats:
        return lambda n, x, w, b: _batchnorm(n, m, x, w, b)
    if type(m) is nn.LayerNorm:
        return lambda n, x, w, b: _layer_norm(n, x, m.normalized_shape, w, b, m.eps)
    if type(m) is nn.GroupNorm:
        return lambda n, x, w, b: _group_norm(n, x, m.num_groups, w, b, m.eps)
    if type(m) is nn.RMSNorm:
        return lambda n, x, w, b: _rms_norm(n, x, m.normalized_shape, w, m.eps)
    return None


def _function_supported(target: Any) -> bool:
    known = set(_SMOOTH) | _LINEAR_OPS | _AFFINE_OPS | _PRIMAL_OPS
    known |= {F.gelu, F.softplus, F.leaky_relu, F.linear, F.conv1d, F.conv2d}
    known |= {operator.mul, torch.mul, "mul", operator.truediv, torch.div, "div"}
    known |= {operator.matmul, torch.matmul, "matmul"} | _NORM_FUNCTIONS
    try:
        return target in known
    except TypeError:
        return False


def _global_hooks() -> bool:
    from torch.nn.modules import module as module_globals

    return bool(module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks)


def _hooks(model: nn.Module) -> list[str]:
    """Names of modules with forward hooks (``torch.fx`` does not run them)."""
    found = [name or "<model>" for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    return found + (["<global forward hooks>"] if _global_hooks() else [])


class TaylorProgram:
    """A model traced with ``torch.fx`` whose every node has a Taylor rule.

    Parameters are looked up by their name in ``model.named_parameters()``; a
    parameter reachable under several names (tied weights) is one jet at every
    use.

    Raises
    ------
    Unsupported
        If tracing fails, a node has no rule, a leaf module owns parameters other
        than ``weight``/``bias`` (its rule would treat them as constants), or a
        module has forward hooks.
    """

    def __init__(self, model: nn.Module) -> None:
        hooked = _hooks(model)
        if hooked:
            raise Unsupported(f"forward hooks on {hooked} (torch.fx does not run them)")
        try:
            with eval_mode(model):
                self.graph_module = torch.fx.symbolic_trace(model)
        except Exception as exc:  # fx raises many kinds of errors on untraceable code
            raise Unsupported(f"torch.fx could not trace the model: {exc}") from exc
        canonical = {id(p): name for name, p in model.named_parameters()}
        canonical_buffers = {id(b): name for name, b in model.named_buffers()}
        try:
            self.param_names = {
                alias: canonical[id(p)] for alias, p in self.graph_module.named_parameters(remove_duplicate=False)
            }
            self.buffer_names = {
                alias: canonical_buffers[id(b)] for alias, b in self.graph_module.named_buffers(remove_duplicate=False)
            }
        except KeyError as exc:
            raise Unsupported("the traced model holds a parameter or buffer the model does not list") from exc
        self.rules: dict[str, Callable[..., Any]] = {}
        placeholders = 0
        for node in self.graph_module.graph.nodes:
            if node.op == "placeholder":
                placeholders += 1
            elif node.op == "call_module":
                sub = self.graph_module.get_submodule(node.target)
                rule = _module_rule(sub)
                if rule is None:
                    raise Unsupported(f"no Taylor rule for module {node.target!r} ({type(sub).__name__})")
                owned = {name for name, _ in sub.named_parameters()} - {"weight", "bias"}
                if owned:
                    raise Unsupported(f"module {node.target!r} has parameters {sorted(owned)} its rule does not read")
                self.rules[node.target] = rule
            elif node.op in ("call_function", "call_method") and not _function_supported(node.target):
                raise Unsupported(f"no Taylor rule for {node.target}")
        if placeholders != 1:
            raise Unsupported("Taylor mode supports models with exactly one input")

    def __repr__(self) -> str:
        nodes = sum(1 for _ in self.graph_module.graph.nodes)
        tied = len(self.param_names) - len(set(self.param_names.values()))
        return f"TaylorProgram(nodes={nodes}, parameters={len(set(self.param_names.values()))}, tied_aliases={tied})"

    def __call__(self, params: Params, buffers: Params, direction: Params, inputs: Tensor, n: int) -> Jet | Tensor:
        """Return the first ``n`` Taylor coefficients of ``model(inputs; θ + s v)``."""
        env: dict[torch.fx.Node, Any] = {}

        def tensor(name: str) -> Any:
            canonical = self.param_names.get(name)
            if canonical is not None:
                return Jet((params[canonical], direction[canonical]))
            canonical = self.buffer_names.get(name)
            if canonical is not None:
                return buffers[canonical]
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


def _structure(model: nn.Module) -> tuple[tuple, list[Any]]:
    """Identity of every module, parameter and buffer under every name, and which modules have hooks.

    Returns the signature and the objects it names: a cache entry keeps them
    alive, so their ids cannot be reused by new objects while it is compared.
    """
    modules = list(model.named_modules(remove_duplicate=False))
    params = list(model.named_parameters(remove_duplicate=False))
    buffers = list(model.named_buffers(remove_duplicate=False))
    signature = (
        tuple((name, id(m), bool(m._forward_hooks or m._forward_pre_hooks)) for name, m in modules),
        _global_hooks(),
        tuple((name, id(p)) for name, p in params),
        tuple((name, id(b)) for name, b in buffers),
    )
    # not the model itself: a value that held its key would keep the WeakKeyDictionary entry alive forever
    return signature, [obj for _, obj in modules[1:] + params + buffers]


_PROGRAMS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, TaylorProgram | str, list[Any]]] = (
    weakref.WeakKeyDictionary()
)


def program_for(model: nn.Module) -> TaylorProgram:
    """Return the cached :class:`TaylorProgram` of ``model``; raises :class:`Unsupported`.

    The program is traced again when a module, parameter or buffer of the model
    has been replaced (re-tied weights, a swapped layer) or hooks were added.
    """
    signature, objects = _structure(model)
    cached = _PROGRAMS.get(model)
    if cached is None or cached[0] != signature:
        try:
            program: TaylorProgram | str = TaylorProgram(model)
        except Unsupported as exc:
            program = str(exc)
        cached = (signature, program, objects)
        _PROGRAMS[model] = cached
    if isinstance(cached[1], str):
        raise Unsupported(cached[1])  # a fresh exception: re-raising one instance would grow its traceback
    return cached[1]


def _mean(c: Tensor, weights: Tensor | None) -> Tensor:
    """Mean over examples, or ``Σ wᵢcᵢ / max(Σ wᵢ, 1)`` (a 0/1 mask: the mean over the examples kept)."""
    return c.mean() if weights is None else (c * weights).sum() / weights.sum().clamp_min(1)


def cross_entropy_series(logits: Jet | Tensor, targets: Tensor, n: int, weights: Tensor | None = None) -> Tensor:
    """Coefficients ``[n]`` of the mean softmax cross-entropy along ``s`` (over the examples ``weights`` keeps).

    Up to order 2 the log-sum-exp coefficients are softmax moments
    (``E_p z₁``, ``E_p z₂ + Var_p(z₁)/2``); beyond, exp/log series recurrences.
    """
    z = _series(logits)
    idx = targets.long().unsqueeze(-1)
    picked = [z[k].gather(-1, idx).squeeze(-1) for k in range(min(n, len(z)))]  # the target's, where z has one
    if n <= 3:
        lse0 = torch.logsumexp(z[0], dim=-1)
        coeffs = [_mean(lse0 - picked[0], weights)]
        if n > 1:
            p = torch.exp(z[0] - lse0.unsqueeze(-1))
            pz1 = p * z[1] if len(z) > 1 else torch.zeros_like(p)
            m1 = pz1.sum(-1)
            coeffs.append(_mean(m1 - picked[1] if len(z) > 1 else m1, weights))
        if n > 2:
            c2 = 0.5 * ((pz1 * z[1]).sum(-1) - m1 * m1) if len(z) > 1 else torch.zeros_like(m1)
            if len(z) > 2:
                c2 = c2 + (p * z[2]).sum(-1) - picked[2]
            coeffs.append(_mean(c2, weights))
        return torch.stack(coeffs)
    shift = z[0].detach().amax(dim=-1, keepdim=True)
    e = series.exp((z[0] - shift, *z[1:]), n)
    lse = series.log(tuple(c.sum(-1) for c in e), n)
    coeffs = [_mean(lse[k] - picked[k] if k < len(picked) else lse[k], weights) for k in range(n)]
    coeffs[0] = coeffs[0] + _mean(shift.squeeze(-1), weights)
    return torch.stack(coeffs)


def mse_series(outputs: Jet | Tensor, targets: Tensor, n: int) -> Tensor:
    """Coefficients ``[n]`` of the mean squared error along ``s``."""
    r = _series(outputs)
    sq = series.square((r[0] - targets, *r[1:]), n)
    coeffs = [c.mean() for c in sq] + [torch.zeros_like(sq[0].mean())] * (n - len(sq))
    return torch.stack(coeffs)


LOSS_SERIES: dict[str, Callable[[Jet | Tensor, Tensor, int], Tensor]] = {
    "cross_entropy": cross_entropy_series, "mse": mse_series}


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
