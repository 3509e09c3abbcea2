"""GGUF quantised blocks -> the arrays ``jaxserve.model.layers.quant.BlockQuant`` keeps on the
device, on the host (numpy), plus the inverse for the two K-quants gguf-py cannot write.

A GGUF matrix is stored row by row (torch layout ``[O, I]``), each row a run of blocks along
``I`` (llama.cpp's ``ggml-common.h``):

    Q8_0  34 B / 32:  d f16, 32 x int8                                  value d * q
    Q4_0  18 B / 32:  d f16, 16 bytes (byte j: element j low nibble, j + 16 high)   d * (q - 8)
    Q4_1  20 B / 32:  d f16, m f16, 16 bytes as Q4_0                    d * q + m
    Q4_K 144 B / 256: d f16, dmin f16, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes
                      (per 64 elements: byte j holds element j low, j + 32 high)
                      value d * sc_s * q - dmin * m_s for sub-block s of 32
    Q6_K 210 B / 256: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 x int8 scales
                      (one per 16 elements), d f16                      value d * sc_s * (q - 32)

``decode_blocks`` splits a tensor's bytes into those fields without changing a value: 4-bit
bytes stay packed as they are, the 6-bit (scale, min) pairs are unpacked to one byte each, Q6_K's
split bits are joined into one int8 per element (8.6 bits a weight, as Q8_0). The device then
computes exactly gguf-py's float32 dequantisation (same operations, same order).
"""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}
BLOCK_SIZE = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q6_K": 256}


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float16 (little-endian, as GGUF stores it)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def q4_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes ``[..., 12]`` -> (scales, mins) uint8 ``[..., 8]``, 6 bits each."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.uint8), mn.astype(np.uint8)


def decode_blocks(raw: np.ndarray, ggml_type: str) -> dict[str, np.ndarray]:
    """A quantised GGUF tensor's bytes -> ``BlockQuant``'s arrays for it (see the class).

    Args:
      raw: uint8 ``[O, row_bytes]``, the tensor's rows (gguf-py's ``ReaderTensor.data``).
      ggml_type: one of ``BLOCK_BYTES``' keys.

    Returns:
      {name: numpy array}, each ``[O, n]``.

    Raises:
      ValueError: another type, or rows that are not whole blocks.
    """
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"GGML type {ggml_type} is not kept as blocks; types: {list(BLOCK_BYTES)}")
    rows, row_bytes = raw.shape
    if row_bytes % BLOCK_BYTES[ggml_type]:
        raise ValueError(f"{ggml_type} rows of {row_bytes} bytes are not whole blocks")
    b = raw.reshape(rows, -1, BLOCK_BYTES[ggml_type])
    if ggml_type == "Q8_0":
        return {
            "weight": np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1),
            "weight_scale": _f16(b[..., 0:2]),
        }
    if ggml_type == "Q4_0":
        return {"weight": b[..., 2:].reshape(rows, -1), "weight_scale": _f16(b[..., 0:2])}
    if ggml_type == "Q4_1":
        return {
            "weight": b[..., 4:].reshape(rows, -1),
            "weight_scale": _f16(b[..., 0:2]),
            "weight_min": _f16(b[..., 2:4]),
        }
    if ggml_type == "Q4_K":
        sc, mn = q4_k_scale_min(b[..., 4:16])
        return {
            "weight": b[..., 16:].reshape(rows, -1),
            "weight_scale": sc.reshape(rows, -1),
            "weight_min": mn.reshape(rows, -1),
            "weight_super_scale": _f16(b[..., 0:2]),
            "weight_super_min": _f16(b[..., 2:4]),
        }
    # Q6_K: element h*128 + s*64 + t has its low nibble in ql[h*64 + t] (s = 0 low, 1 high),
    # its high 2 bits in qh[h*32 + (s*64 + t) % 32] at bit 2 * ((s*64 + t) // 32).
    n = b.shape[1]
    ql = b[..., 0:128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    ql = (ql & 0x0F).reshape(rows, n, 2, 128)
    qh = b[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        4, 1
    )
    qh = (qh & 0x03).reshape(rows, n, 2, 128)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    return {
        "weight": q.reshape(rows, -1),
        "weight_scale": np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(rows, -1),
        "weight_super_scale": _f16(b[..., 208:210]),
    }


def _nearest(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 ``[O, I]`` (I a multiple of 256) -> Q4_K bytes ``[O, I / 256 * 144]``: a plain
    min/max quantiser (llama.cpp's searches its scales; any valid blocks do for fixtures and
    benchmarks, whose reference is the dequantised file)."""
    rows = x.shape[0]
    sub = x.reshape(rows, -1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15.0
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_nearest(np.where(df > 0, scale / df, 0)), 0, 63).astype(np.uint8)
        mn = np.clip(_nearest(np.where(dminf > 0, -lo / dminf, 0)), 0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, (sub + (dminf * mn)[..., None]) / step, 0)
    q = np.clip(_nearest(q), 0, 15).astype(np.uint8).reshape(rows, -1, 4, 2, 32)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, -1, 128)
    packed = np.concatenate(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)
    head = np.concatenate(
        [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed], axis=-1
    )
    return np.concatenate([head, qs], axis=-1).reshape(rows, -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 ``[O, I]`` (I a multiple of 256) -> Q6_K bytes ``[O, I / 256 * 210]``
    (absmax per 16 elements; see ``encode_q4_k``)."""
    rows = x.shape[0]
    sub = x.reshape(rows, -1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31.0
    d = (np.abs(scale).max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_nearest(np.where(df > 0, scale / df, 0)), -128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.where(step != 0, sub / step, 0)
    q = (np.clip(_nearest(q), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 256)
    n = q.shape[1]
    low, high = q & 0x0F, q >> 4
    low = low.reshape(rows, n, 2, 2, 64)
    ql = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(rows, n, 128)
    high = high.reshape(rows, n, 2, 4, 32)
    qh = sum(high[..., s, :] << (2 * s) for s in range(4)).astype(np.uint8).reshape(rows, n, 64)
    return np.concatenate(
        [ql, qh, sc.view(np.uint8), d[..., None].view(np.uint8)], axis=-1
    ).reshape(rows, -1)
