# Stub of the C extension built from _stream.c (optional: rawio falls back without it).
from typing_extensions import Buffer

STORES: str  # "avx2", "sse2" (streaming stores) or "memcpy" (a CPU without them)

def copy(dst: Buffer, src: Buffer, /) -> None: ...
