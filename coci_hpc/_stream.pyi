# Stub of the C extension built from _stream.c (optional: rawio falls back without it).
from typing import Any

STORES: str  # "avx2", "sse2" (streaming stores) or "memcpy" (a CPU without them)

def copy(dst: Any, src: Any, /) -> None: ...  # two C-contiguous buffers of one length; dst writable
# where crc32c / copy_crc32c run: "vpclmulqdq" (AVX-512), "vpclmulqdq-avx2" (AVX2 + VPCLMULQDQ), else None
CRC: str | None

def crc32c(buf: Any, value: int = 0, /) -> int: ...  # as crc32c.crc32c(buf, value)
def copy_crc32c(dst: Any, src: Any, value: int = 0, /) -> int: ...  # copy (streaming) + its CRC-32C
def set_fold(width: int, /) -> int: ...  # 512, 256 or 0 where the CPU can; returns the width before (tests)
