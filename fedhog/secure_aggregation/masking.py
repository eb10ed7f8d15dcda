"""The masks of SecAgg+: uniform vectors mod M expanded from a 256-bit key with ChaCha20.

Flower's ``pseudo_rand_gen`` folds its seed to 32 bits and expands it with
NumPy's Mersenne Twister, so a server could search all 2³² seeds of a mask;
and it draws from 0..M−2, so masked values are not uniform. Here the key
(Flower's HKDF-derived pairwise key, or the client's 32-byte self-mask seed)
keys ChaCha20 (``cryptography``, i.e. OpenSSL), and the keystream's words,
reduced mod M = 2^b (a power of two: no bias), are the mask. Each key masks
one vector of one round (keys are fresh every round), so the fixed nonce is
never reused under a key.
"""

from __future__ import annotations

import base64

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

_NONCE = bytes(16)  # counter 0, nonce 0: each key expands one mask only


def mask(key: bytes, count: int, modulus_bits: int) -> np.ndarray:
    """``count`` words uniform mod 2^``modulus_bits`` (uint64) from a 32-byte key (raw or url-safe base64)."""
    raw = key if len(key) == 32 else base64.urlsafe_b64decode(key)
    if len(raw) != 32:
        raise ValueError(f"a mask key must hold 32 bytes, got {len(raw)}")
    words = np.zeros(count, dtype="<u8")
    buffer = words.data.cast("B")
    Cipher(algorithms.ChaCha20(raw, _NONCE), mode=None).encryptor().update_into(buffer, buffer)
    return words.astype(np.uint64, copy=False) & np.uint64((1 << modulus_bits) - 1)
