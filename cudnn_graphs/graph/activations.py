"""Activations as cuDNN pointwise ops, forward and backward.

The frontend exposes no ELU alpha or softplus beta attribute, so those are composed from other
pointwise ops; alpha = 1 and beta = 1 use the single native op. Backward modes take the forward's
pre-activation input (cuDNN's *_BWD pointwise modes compute dy * f'(x)).
"""

from __future__ import annotations

from typing import Any

from gpu_launch.activations import Activation

_FORWARD = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_approx_tanh", "silu": "swish",
            "sigmoid": "sigmoid", "tanh": "tanh"}
_BACKWARD = {name: f"{op}_backward" for name, op in _FORWARD.items()}


def activation_forward(g: Any, t: Any, act: Activation, scalars: Any) -> Any:
    name = act.name
    if name == "identity":
        return t
    if name in _FORWARD:
        return getattr(g, _FORWARD[name])(input=t, name=name)
    if name == "leaky_relu":
        return g.leaky_relu(input=t, negative_slope=act.param, name=name)
    if name == "elu":
        return _elu(g, t, act.param, scalars)
    if name == "softplus":
        return _softplus(g, t, act.param, scalars)
    raise AssertionError(f"unhandled activation {name}")  # Activation validated the name


def activation_backward(g: Any, loss: Any, pre: Any, act: Activation, scalars: Any) -> Any:
    """d(pre) = loss * act'(pre)."""
    name = act.name
    if name == "identity":
        return loss
    if name in _BACKWARD:
        return getattr(g, _BACKWARD[name])(loss=loss, input=pre, name=f"{name}_backward")
    if name == "leaky_relu":
        return g.leaky_relu_backward(loss=loss, input=pre, negative_slope=act.param, name="leaky_relu_backward")
    if name == "elu":
        return _elu_backward(g, loss, pre, act.param, scalars)
    if name == "softplus":
        return _softplus_backward(g, loss, pre, act.param, scalars)
    raise AssertionError(f"unhandled activation {name}")


def _elu(g, t, alpha: float, scalars) -> Any:
    e = g.elu(input=t, name="elu")
    if alpha == 1.0:
        return e
    # elu_a(t) = max(t, 0) + a * min(elu(t), 0), since min(elu(t), 0) = exp(min(t, 0)) - 1.
    zero = scalars.const(g, 0.0, "zero")
    neg = g.scale(input=g.min(input0=e, input1=zero, name="elu_neg"), scale=scalars.const(g, alpha, "elu_alpha"))
    return g.add(a=g.max(input0=t, input1=zero, name="elu_pos"), b=neg, name="elu_alpha")


def _elu_backward(g, loss, pre, alpha: float, scalars) -> Any:
    d = g.elu_backward(loss=loss, input=pre, name="elu_backward")
    if alpha == 1.0:
        return d
    # With d = loss * (pre > 0 ? 1 : exp(pre)): a*d + (1-a)*relu'(pre)*d = loss * (pre > 0 ? 1 : a*exp(pre)).
    scaled = g.scale(input=d, scale=scalars.const(g, alpha, "elu_alpha"), name="elu_scaled")
    pos = g.scale(input=g.relu_backward(loss=d, input=pre, name="elu_pos_backward"),
                  scale=scalars.const(g, 1.0 - alpha, "elu_one_minus_alpha"))
    return g.add(a=scaled, b=pos, name="elu_alpha_backward")


def _softplus(g, t, beta: float, scalars) -> Any:
    if beta == 1.0:
        return g.softplus(input=t, name="softplus")
    # softplus_b(t) = softplus(b * t) / b
    inner = g.softplus(input=g.scale(input=t, scale=scalars.const(g, beta, "softplus_beta")), name="softplus")
    return g.scale(input=inner, scale=scalars.const(g, 1.0 / beta, "softplus_inv_beta"), name="softplus_beta")


def _softplus_backward(g, loss, pre, beta: float, scalars) -> Any:
    if beta != 1.0:
        # d/dt softplus(b t)/b = sigmoid(b t) = softplus'(b t)
        pre = g.scale(input=pre, scale=scalars.const(g, beta, "softplus_beta"), name="softplus_scaled_input")
    return g.softplus_backward(loss=loss, input=pre, name="softplus_backward")
