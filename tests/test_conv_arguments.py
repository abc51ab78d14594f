"""CPU: one normaliser for stride, padding, dilation and groups (`spec.geometry.conv_arguments`): a bad
value raises the same SpecError, naming the field and the value, from the request path and the torch path."""

from __future__ import annotations

import pytest

from cudnn_graphs import ConvFwdRequest, ConvFwdSpec, SpecError
from cudnn_graphs.spec import geometry

from .test_requests import FakeCuda

torch = pytest.importorskip("torch")
cgt = pytest.importorskip("cudnn_graphs.torch")

BAD = [
    ("stride", 0), ("stride", -1), ("stride", (1, 2, 3)), ("stride", (0, 1)), ("stride", "2"), ("stride", 2.0),
    ("stride", True), ("stride", None), ("stride", [1, 1.5]),
    ("dilation", 0), ("dilation", [1, 2, 3]), ("dilation", 1.5),
    ("padding", -1), ("padding", (1, 2, 3)), ("padding", "full"), ("padding", (1, -1)), ("padding", ("a", 1)),
    ("padding", 1.0),
    ("groups", 0), ("groups", -1), ("groups", 1.0), ("groups", True), ("groups", "1"),
]


def _request_error(**kwargs) -> SpecError:
    with pytest.raises(SpecError) as err:
        ConvFwdRequest(FakeCuda((1, 2, 6, 6), dtype="float32"), FakeCuda((3, 2, 3, 3), dtype="float32"),
                       **kwargs).spec()
    return err.value


def _torch_error(**kwargs) -> SpecError:
    with pytest.raises(SpecError) as err:
        cgt.conv2d(torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3), **kwargs)
    return err.value


@pytest.mark.parametrize("field, value", BAD, ids=lambda v: repr(v))
def test_a_bad_argument_says_the_same_from_the_request_and_the_torch_path(field, value):
    request, torch_path = _request_error(**{field: value}), _torch_error(**{field: value})
    assert (request.field, torch_path.field) == (field, field)
    assert str(request) == str(torch_path), (request, torch_path)
    assert str(request).startswith(f"{field}={value!r}: ")


def test_same_padding_with_a_stride_says_the_same_from_both_paths():
    request, torch_path = _request_error(padding="same", stride=2), _torch_error(padding="same", stride=2)
    assert str(request) == str(torch_path) == "padding='same': 'same' needs stride 1, as in PyTorch (stride=(2, 2))"


def test_the_messages_name_what_is_expected():
    assert str(_request_error(stride=(1, 2, 3))) == "stride=(1, 2, 3): expected an int >= 1 or 2 of them"
    assert str(_request_error(padding=-1)) == "padding=-1: expected 'valid', 'same', an int >= 0 or 2 of them"
    assert str(_request_error(padding="full")) == "padding='full': the string forms are 'valid' and 'same'"
    assert str(_request_error(groups=0)) == "groups=0: expected an int >= 1"


def test_torch_spellings_stay_torchs():
    """torch's rules: one value for every dim and any __index__ integer pass; pairs do not (torch pads both
    sides alike). The specs keep theirs: exactly one value per dim, (pre, post) pairs."""
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    torch.testing.assert_close(cgt.conv2d(x, w, stride=[2], padding=(1,)), torch.nn.functional.conv2d(x, w, stride=2,
                                                                                                     padding=1))
    with pytest.raises(SpecError, match="pad both sides alike"):
        cgt.conv2d(x, w, padding=((1, 0), (0, 1)))
    assert ConvFwdSpec((1, 2, 6, 6), (3, 2, 3, 3), padding=((1, 0), (0, 1))).padding == ((1, 0), (0, 1))
    with pytest.raises(SpecError, match="2 of them"):
        ConvFwdSpec((1, 2, 6, 6), (3, 2, 3, 3), stride=[2])

    class Two:
        def __index__(self):
            return 2

    assert geometry.per_dim("stride", Two(), 2, minimum=1, torch_rules=True) == (2, 2)
    assert geometry.per_dim("stride", torch.tensor(2), 2, minimum=1, torch_rules=True) == (2, 2)
    with pytest.raises(SpecError):
        geometry.per_dim("stride", Two(), 2, minimum=1)
    # values beyond int32: refused by the spec, left to torch's own convolution under torch's rules
    assert geometry.per_dim("stride", 2**40, 2, minimum=1, torch_rules=True) == (2**40, 2**40)
    with pytest.raises(SpecError, match="at most"):
        geometry.per_dim("stride", 2**40, 2, minimum=1)
