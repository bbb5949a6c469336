"""GGUF blocks gguf's Python package cannot write: the K-quants Q4_K and Q6_K that llama.cpp's
Q4_K_M files hold (gguf dequantizes them, it does not quantize them), and random blocks of any
kept type for the kernel tests.

`quantize` is a plain round-to-nearest quantizer (llama.cpp searches scales that lower the
error; the layout is the same): what the tests need is valid blocks whose values gguf's own
dequantizer reads back (`tests/engine/test_quantized_linear.py` checks that it does).
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    """float16 bytes of `values`: [..., 2] uint8."""
    return np.asarray(values, np.float16).view(np.uint8).reshape(*np.shape(values), 2)


def _round_to(values: np.ndarray, step: np.ndarray, low: int, high: int) -> np.ndarray:
    safe = np.where(step > 0, step, 1.0)
    return np.clip(np.where(step > 0, np.rint(values / safe), 0), low, high).astype(np.int32)


def _q4_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] Q4_K blocks: per 32 values a 6-bit scale and min of the
    super-block's float16 d and dmin; codes w = d sc q - dmin m, q 0..15."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale, minimum = (sub.max(-1) - low) / 15, -low
    d = _f16(scale.max(-1) / 63).view(np.float16)[..., 0].astype(np.float32)
    dmin = _f16(minimum.max(-1) / 63).view(np.float16)[..., 0].astype(np.float32)
    sc = _round_to(scale, d[:, None], 0, 63)
    m = _round_to(minimum, dmin[:, None], 0, 63)
    step = (d[:, None] * sc)[..., None]
    q = _round_to(sub + (dmin[:, None] * m)[..., None], step, 0, 15)
    packed = np.zeros((len(x), 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    # 32 bytes per pair of sub-blocks: the even one's codes in the low nibbles.
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(len(x), 128)
    return np.concatenate([_f16(d), _f16(dmin), packed, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] Q6_K blocks: per 16 values an int8 scale of the
    super-block's float16 d; w = d sc (q - 32), q 0..63 as 4 low bits (ql) and 2 high (qh)."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 32
    d = _f16(np.abs(scale).max(-1) / 127).view(np.float16)[..., 0].astype(np.float32)
    sc = _round_to(scale, d[:, None], -128, 127)
    q = (_round_to(sub, (d[:, None] * sc)[..., None], -32, 31) + 32).reshape(-1, 2, 4, 32)
    # Per half of 128 values, quarters t = 0..3: ql[32 (t & 1) + l] holds quarter t's 4 low bits
    # (t < 2 low nibble), qh[l] bits 2t..2t+1 its 2 high bits (ggml's dequantize_row_q6_K).
    low = q & 15
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    )
    high = q >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [
            ql.astype(np.uint8).reshape(len(x), 128),
            qh.astype(np.uint8).reshape(len(x), 64),
            sc.astype(np.int8).view(np.uint8),
            _f16(d),
        ],
        axis=1,
    )


_K_QUANTIZERS = {Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}


def quantize(array: np.ndarray, qtype: Q) -> np.ndarray:
    """`array` ([..., K]) in `qtype`'s blocks, as gguf.quants.quantize returns them ([..., K /
    values * bytes] uint8): gguf's quantizer where it has one, else Q4_K / Q6_K here."""
    if qtype not in _K_QUANTIZERS:
        return gguf.quants.quantize(array, qtype)
    rows = np.asarray(array, np.float32).reshape(-1, array.shape[-1])
    if rows.shape[1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values")
    blocks = _K_QUANTIZERS[qtype](rows.reshape(-1, QK_K))
    return blocks.reshape(*array.shape[:-1], -1)


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, K / values * bytes] uint8 blocks of `qtype` with random codes and scales, and float16
    factors set to small finite values (random bytes there could be inf or NaN)."""
    rng = np.random.default_rng(seed)
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)

    def factor(low: float, high: float) -> np.ndarray:
        return _f16(rng.uniform(low, high, size=raw.shape[:2]))

    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin
        raw[..., 0:2], raw[..., 2:4] = factor(5e-4, 3e-3), factor(5e-4, 3e-3)
    elif qtype == Q.Q6_K:  # d last
        raw[..., 208:210] = factor(1e-4, 1e-3)
    else:  # d, then Q4_1 / Q5_1's m
        raw[..., 0:2] = factor(-0.01, 0.01)
        if qtype in (Q.Q4_1, Q.Q5_1):
            raw[..., 2:4] = factor(-0.1, 0.1)
    return raw.reshape(n, -1)
