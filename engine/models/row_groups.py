"""How a GGUF weight's rows sit interleaved by groups of 8 (`QuantizedRows.interleave` in
quantized_linear.py, read by kernels/csrc/cpu_gguf.cpp's rows8/rows16 tiles): the layouts beyond
the plain runs of code bytes, each with its exact undoing. Q5_0 adds its fifth bits; the K-quants
keep each block's scales a byte per row beside Q4_0's runs of nibbles."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
GROUP_ROWS = 8


def q4_k_grouped(blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """Q4_K rows [N, K / 256 * 144] interleaved by 8: per group and super-block, the 8 rows'
    float16 d, their float16 dmin, per block j of 32 the rows' 6-bit scales sc_j and mins m_j
    as bytes (8 + 8), then per block 4 runs of 32 bytes as Q4_0's (the byte of value t holding
    t + 16's nibble high). [N / 8, K / 256 * 1184]."""
    g, ns = n // GROUP_ROWS, k // 256
    a = blocks.reshape(g, GROUP_ROWS, ns, 144).transpose(0, 2, 1, 3)  # [g, ns, 8 rows, 144]
    q = a[..., 4:16].astype(np.uint8)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | (q[..., 0:4] >> 6) << 4], -1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | (q[..., 4:8] >> 6) << 4], -1)
    scales = np.stack([sc.swapaxes(-1, -2), mn.swapaxes(-1, -2)], axis=-2)  # [g, ns, 8 j, 2, 8]
    qs = a[..., 16:].reshape(g, ns, GROUP_ROWS, 4, 32)  # block pair i: 2 i low, 2 i + 1 high
    values = np.stack([qs & 15, qs >> 4], axis=-2).reshape(g, ns, GROUP_ROWS, 8, 32)
    packed = values[..., :16] | values[..., 16:] << 4  # [g, ns, 8 rows, 8 j, 16]
    runs = packed.reshape(g, ns, GROUP_ROWS, 8, 4, 4).transpose(0, 1, 3, 4, 2, 5)
    parts = [a[..., 0:2].reshape(g, ns, 16), a[..., 2:4].reshape(g, ns, 16),
             scales.reshape(g, ns, 128), runs.reshape(g, ns, 1024)]  # fmt: skip
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(g, ns * 1184))


def q4_k_ungrouped(grouped: np.ndarray, n: int, k: int) -> np.ndarray:
    """`q4_k_grouped` undone: the file's rows [N, K / 256 * 144]."""
    g, ns = n // GROUP_ROWS, k // 256
    x = grouped.reshape(g, ns, 1184)
    d, dmin = x[..., 0:16].reshape(g, ns, 8, 2), x[..., 16:32].reshape(g, ns, 8, 2)
    scales = x[..., 32:160].reshape(g, ns, 8, 2, GROUP_ROWS)
    sc, mn = scales[..., 0, :].swapaxes(-1, -2), scales[..., 1, :].swapaxes(-1, -2)  # [.., 8, j]
    q = np.concatenate(
        [sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
         (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4], axis=-1,
    )  # fmt: skip
    packed = x[..., 160:].reshape(g, ns, 8, 4, GROUP_ROWS, 4).transpose(0, 1, 4, 2, 3, 5)
    packed = packed.reshape(g, ns, GROUP_ROWS, 8, 16)
    values = np.concatenate([packed & 15, packed >> 4], axis=-1)  # [.., 8 rows, 8 j, 32]
    qs = values[..., 0::2, :] | values[..., 1::2, :] << 4  # [.., 8 rows, 4 pairs, 32]
    rows = np.concatenate([d, dmin, q.astype(np.uint8), qs.reshape(g, ns, GROUP_ROWS, 128)], -1)
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(n, ns * 144)


def q6_k_grouped(blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """Q6_K rows [N, K / 256 * 210] interleaved by 8: per group and super-block, the 8 rows'
    float16 d, per block j of 32 the rows' int8 scales of its values 0-15 and 16-31 (8 + 8), then
    per block 4 runs of the 6-bit codes' low 4 bits as Q4_0's and 64 bytes of their top 2 bits
    (byte 4 r + p, bits 2 g and 2 g + 1: row r's of value 4 g + p, values 0-15 then 16-31).
    The same size."""
    g, ns = n // GROUP_ROWS, k // 256
    a = blocks.reshape(g, GROUP_ROWS, ns, 210).transpose(0, 2, 1, 3)  # [g, ns, 8 rows, 210]
    ql, qh = a[..., 0:128].reshape(g, ns, 8, 2, 2, 32), a[..., 128:192].reshape(g, ns, 8, 2, 32)
    # ggml's dequantize_row_q6_K: value 128 n + 32 i + l from ql[n, i % 2] (high nibble for
    # i >= 2) and bits 2 i, 2 i + 1 of qh[n, l].
    quarters = [(ql[..., i % 2, :] >> (4 * (i // 2)) & 15) | ((qh >> (2 * i)) & 3) << 4
                for i in range(4)]  # fmt: skip
    codes = np.stack(quarters, axis=-2).reshape(g, ns, 8, 8, 32)  # [.., rows, block j, 32]
    scales = a[..., 192:208].reshape(g, ns, 8, 8, 2).transpose(0, 1, 3, 4, 2)  # [.., j, 2, rows]
    nibbles = (codes[..., :16] & 15) | (codes[..., 16:] & 15) << 4  # [.., rows, j, 16]
    runs = nibbles.reshape(g, ns, 8, 8, 4, 4).transpose(0, 1, 3, 4, 2, 5)  # [.., j, run, rows, 4]
    tops = (codes >> 4).reshape(g, ns, 8, 8, 2, 4, 4)  # [.., rows, j, half, run, p]
    packed = sum(tops[..., q, :] << (2 * q) for q in range(4)).astype(np.uint8)
    tops = packed.transpose(0, 1, 3, 4, 2, 5)  # [.., j, half, rows, p]
    per_block = np.concatenate([runs.reshape(g, ns, 8, 128), tops.reshape(g, ns, 8, 64)], -1)
    parts = [a[..., 208:210].reshape(g, ns, 16), scales.reshape(g, ns, 128),
             per_block.reshape(g, ns, 8 * 192)]  # fmt: skip
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(g, ns * 1680))


def q6_k_ungrouped(grouped: np.ndarray, n: int, k: int) -> np.ndarray:
    """`q6_k_grouped` undone: the file's rows [N, K / 256 * 210]."""
    g, ns = n // GROUP_ROWS, k // 256
    x = grouped.reshape(g, ns, 1680)
    d = x[..., 0:16].reshape(g, ns, 8, 2)
    scales = x[..., 16:144].reshape(g, ns, 8, 2, 8).transpose(0, 1, 4, 2, 3).reshape(g, ns, 8, 16)
    per_block = x[..., 144:].reshape(g, ns, 8, 192)
    runs = per_block[..., :128].reshape(g, ns, 8, 4, 8, 4).transpose(0, 1, 4, 2, 3, 5)
    nibbles = runs.reshape(g, ns, 8, 8, 16)  # [.., rows, j, 16]
    tops = per_block[..., 128:].reshape(g, ns, 8, 2, 8, 4).transpose(0, 1, 4, 2, 3, 5)
    # [.., rows, j, half, run, p]
    tops = np.stack([(tops >> (2 * q)) & 3 for q in range(4)], axis=-2)
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)
    codes = low | tops.reshape(g, ns, 8, 8, 32) << 4  # [.., rows, j, 32]
    quarters = codes.reshape(g, ns, 8, 2, 4, 32)  # value 128 n + 32 i + l
    ql = np.stack([(quarters[..., i, :] & 15) | (quarters[..., i + 2, :] & 15) << 4
                   for i in range(2)], axis=-2)  # fmt: skip
    qh = sum((quarters[..., i, :] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)
    rows = np.concatenate([ql.reshape(g, ns, 8, 128), qh.reshape(g, ns, 8, 64),
                           scales, d], axis=-1)  # fmt: skip
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(n, ns * 210)


def fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0's fifth bits of a group's block, the 8 rows' 4 bytes of `qh` [..., 8, 4] (bit v of
    the little-endian word: value v's), as the kernels take them: 32 bytes [..., 32], byte
    4 r + p holding in bit g row r's bit of value 4 g + p, the value whose code the run g of
    nibbles holds at that byte (runs 4-7: the high nibbles)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 8 rows, 32 values]
    by_run = bits.reshape(*bits.shape[:-1], 8, 4).swapaxes(-1, -2)  # [..., 8, p, g]
    return np.packbits(by_run, axis=-1, bitorder="little").reshape(*qh.shape[:-2], 32)


def fifth_bits_back(masks: np.ndarray) -> np.ndarray:
    """`fifth_bits` undone: [..., 32] -> each row's 4 bytes of qh [..., 8, 4]."""
    by_run = np.unpackbits(masks.reshape(*masks.shape[:-1], 8, 4, 1), axis=-1, bitorder="little")
    bits = by_run.swapaxes(-1, -2).reshape(*masks.shape[:-1], 8, 32)
    return np.packbits(bits, axis=-1, bitorder="little")


# Each interleaved K-quant's grouping and its undoing.
K_QUANT_GROUPS = {Q.Q4_K: (q4_k_grouped, q4_k_ungrouped), Q.Q6_K: (q6_k_grouped, q6_k_ungrouped)}
