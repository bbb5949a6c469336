"""The kernel backends keep one contract (kernels/backend.py `KernelBackend`): every op, with the
contract's parameters (names, kinds, defaults, annotations) and return annotation."""

from __future__ import annotations

import inspect

import pytest

from pagedserve import kernels
from pagedserve.kernels import cpu_ops, reference, triton_ops
from pagedserve.kernels.backend import OPS, KernelBackend


def _annotation(annotation) -> str:
    """An annotation's text, `torch.Tensor` and `Tensor` alike."""
    return " ".join(str(annotation).split()).replace("torch.Tensor", "Tensor")


def _shape(fn) -> tuple:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return (
        [(p.name, p.kind, p.default, _annotation(p.annotation)) for p in params],
        _annotation(inspect.signature(fn).return_annotation),
    )


def test_the_contract_lists_the_ops_the_model_calls():
    assert OPS == (
        "paged_attention", "reshape_and_cache", "copy_blocks", "rms_norm", "fused_add_rms_norm",
        "silu_and_mul", "gelu_tanh_and_mul", "rotary_and_cache", "moe_route", "fused_moe",
    )  # fmt: skip


@pytest.mark.parametrize("backend", [reference, cpu_ops, triton_ops], ids=lambda m: m.__name__)
@pytest.mark.parametrize("op", OPS)
def test_each_backend_has_each_op_with_the_contracts_signature(backend, op):
    assert _shape(getattr(backend, op)) == _shape(getattr(KernelBackend, op))


@pytest.mark.parametrize("op", OPS)
def test_the_dispatchers_take_the_contracts_signature(op):
    # kernels.<op> sends each call to the backend of its tensors' device.
    assert op in kernels.__all__
    assert _shape(getattr(kernels, op)) == _shape(getattr(KernelBackend, op))


def test_a_signature_that_differs_is_seen():
    # Guards the comparison itself.
    def rms_norm(x, weight, eps, *, unit_offset=True): ...

    assert _shape(rms_norm) != _shape(KernelBackend.rms_norm)
