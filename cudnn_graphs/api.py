"""Module-level entry points: `run(request)` and the functional helpers, on a default session per device."""

from __future__ import annotations

from typing import Any

from .plan import Session, default_session
from .requests import ConvBwdDataRequest, ConvBwdFilterRequest, ConvFwdRequest, run_buffers

__all__ = ["conv_bwd_data", "conv_bwd_filter", "conv_fwd", "default_session", "run"]


def run(request, *, stream: Any = None, session: Session | None = None) -> Any:
    """`session.run(request)` on the given session, else the default one of the buffers' device."""
    return request._run(session, stream)


# The helpers go straight to `run_buffers` with their arguments in the request's role order: no
# request object, each buffer read once, a repeated geometry one memo lookup.

def conv_fwd(x: Any, w: Any, bias: Any = None, *, z: Any = None, y: Any = None, stream: Any = None,
             session: Session | None = None, **conv_params: Any) -> Any:
    """y = act(alpha * conv(x, w) + bias + beta * z); conv_params as ConvFwdSpec (padding, stride, ...)."""
    return run_buffers(ConvFwdRequest, (x, w, bias, z, y), conv_params, (), session=session, stream=stream)


def conv_bwd_data(dy: Any, w: Any, *, dx: Any = None, pre_act: Any = None, x_shape: Any = None,
                  stream: Any = None, session: Session | None = None, **conv_params: Any) -> Any:
    """dx = dgrad(dy, w), times act'(pre_act) when `activation_backward` is given."""
    return run_buffers(ConvBwdDataRequest, (dy, w, pre_act, dx), conv_params, (x_shape,), session=session,
                       stream=stream)


def conv_bwd_filter(x: Any, dy: Any, *, dw: Any = None, db: Any = None, w_shape: Any = None,
                    bias_grad: bool | None = None, stream: Any = None, session: Session | None = None,
                    **conv_params: Any) -> Any:
    """dw = wgrad(x, dy); returns (dw, db) when `db` or `bias_grad=True` is given."""
    return run_buffers(ConvBwdFilterRequest, (x, dy, dw, db), conv_params, (w_shape, bias_grad), session=session,
                       stream=stream)
