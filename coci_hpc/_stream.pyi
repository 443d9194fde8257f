# Stub of the C extension built from _stream.c (optional: rawio falls back without it).
from typing import Any

STORES: str  # "avx2", "sse2" (streaming stores) or "memcpy" (a CPU without them)

def copy(dst: Any, src: Any, /) -> None: ...  # two C-contiguous buffers of one length; dst writable
