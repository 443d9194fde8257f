/* coci_hpc._stream: a memory copy with non-temporal (streaming) stores.
 *
 * Why this exists (issue 33): a load copies each rank's checked bytes from the page cache into
 * the live state once every rank's check passed. The destination is not read again before the
 * next training step, and is far larger than any cache, so ordinary stores only cost a read of
 * every destination line before it is overwritten (read for ownership) and evict the cache.
 * glibc's memcpy switches to streaming stores only above a process-wide threshold (three
 * quarters of the shared cache it detects: 99 MB on the development VM, above any one tensor),
 * settable only through GLIBC_TUNABLES at process start; neither numpy nor torch offers such a
 * copy, and no kept library we know of does. Measured on the development VM (two processes, each
 * copying 512 MB from a mapped, cached file into 22 MB buffers it had written, 7 rounds):
 * numpy.copyto 0.073-0.091 s, this copy 0.050-0.059 s, glibc with its threshold lowered to
 * 1 MB 0.044-0.050 s.
 *
 * copy(dst, src): dst a writable, src any C-contiguous buffer of the same length. The GIL is
 * released for the copy. x86-64 streams with AVX2 where the CPU has it, else SSE2 (part of
 * x86-64); elsewhere it is plain memcpy. Ends with a store fence: the bytes are visible to every
 * thread once it returns.
 *
 * crc32c(buf, value) and copy_crc32c(dst, src, value): CRC-32C (Castagnoli, the checksum of every
 * checkpoint piece, chained like crc32c.crc32c(buf, value)) by carry-less multiplication over
 * 512-bit registers (AVX-512 + VPCLMULQDQ), the second in the same pass as a streaming copy.
 * Why not the crc32c library alone (issue 33): it checks 13-15 GB/s on one core of the
 * development VM's AMD EPYC (SSE4.2 crc32 instructions), and an asynchronous persist spends
 * 37-46 % of its CPU there, CPU that training ranks on busy cores lose; no library can fold the
 * checksum into the snapshot copy, whose loads it then shares. Folding follows Gopal et al.,
 * "Fast CRC computation for generic polynomials using PCLMULQDQ" (Intel, 2009), for a reflected
 * CRC: a 128-bit lane X (bytes in file order, little-endian) moves D bits forward as
 * clmul(X.lo, x^(64+D-1) mod P) ^ clmul(X.hi, x^(D-1) mod P), each constant bit-reflected into
 * a 64-bit word (the -1: a product of two reflected words lands one bit low). The folded 128
 * bits are then reduced with two crc32 instructions. Over 512-bit registers where the CPU has
 * AVX-512F/BW/VL, VPCLMULQDQ, PCLMULQDQ and SSE4.2 (CRC names it "vpclmulqdq"); over 256-bit
 * registers where it has AVX2, VPCLMULQDQ, PCLMULQDQ and SSE4.2 only ("vpclmulqdq-avx2"); else
 * CRC is None and callers use the crc32c library. set_fold(width) picks the narrower fold on a
 * CPU with both, for tests; tests/checkpoint/test_stream_copy.py checks each fold against the
 * library for every length to 1 KiB, unaligned buffers and chained values.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define COCI_STREAM 1

__attribute__((target("avx2"))) static void copy_avx2(char *dst, const char *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31; /* streaming stores want aligned lines */
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 128; n -= 128, src += 128, dst += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    _mm_sfence();
    memcpy(dst, src, n);
}

static void copy_sse2(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    _mm_sfence();
    memcpy(dst, src, n);
}

/* The fold needs compilers that know AVX-512 VPCLMULQDQ intrinsics (GCC 8, clang 8); with an
 * older one the extension still builds, streaming copies only (CRC is None). */
#if defined(__clang__) ? (__clang_major__ >= 8) : (__GNUC__ >= 8)
#define COCI_FOLD 1

/* The fold constants: for a distance D, {reflect64(x^(64+D-1) mod P), reflect64(x^(D-1) mod P)}
 * with P the CRC-32C polynomial 0x1EDC6F41 (computed in Python, the derivation above). */
#define K128_LO 0x3743f7bd00000000ULL
#define K128_HI 0x3171d43000000000ULL
#define K256_LO 0x33ccbbbc00000000ULL
#define K256_HI 0xa2158b3400000000ULL
#define K384_LO 0xa46ef4aa00000000ULL
#define K384_HI 0x6051243f00000000ULL
#define K512_LO 0x1c19243b00000000ULL
#define K512_HI 0x75bba45b00000000ULL
#define K2048_LO 0xe9a5d8be00000000ULL
#define K2048_HI 0x1426a81500000000ULL

#define FOLD_TARGET "avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,sse4.2"

/* The register r (not inverted) over n bytes with crc32 instructions, copying them to dst if set. */
/* (sse4.2 only: the 256-bit fold calls it on CPUs without AVX-512, which its code must not use) */
__attribute__((target("sse4.2"))) static uint32_t crc_bytes(uint32_t r, char *dst, const char *src, size_t n)
{
    if (dst != NULL)
        memcpy(dst, src, n);
    for (; n >= 8; n -= 8, src += 8) {
        uint64_t v;
        memcpy(&v, src, 8);
        r = (uint32_t)_mm_crc32_u64(r, v);
    }
    for (; n > 0; n--, src++)
        r = _mm_crc32_u8(r, (unsigned char)*src);
    return r;
}

__attribute__((target(FOLD_TARGET))) static inline __m512i fold512(__m512i x, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}

__attribute__((target("pclmul,sse4.2"))) static inline __m128i fold128(__m128i x, uint64_t klo, uint64_t khi)
{
    __m128i k = _mm_set_epi64x((long long)khi, (long long)klo);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

/* Before a fold that copies: CRC and copy the bytes up to dst's next multiple of align (streaming
 * stores want aligned lines), advancing dst, src and n past them; returns the register. */
__attribute__((target("sse4.2"))) static uint32_t crc_head(uint32_t r, char **dst, const char **src, size_t *n,
                                                           size_t align)
{
    if (*dst == NULL)
        return r;
    size_t head = (align - ((uintptr_t)*dst & (align - 1))) & (align - 1);
    if (head > *n)
        head = *n;
    r = crc_bytes(r, *dst, *src, head);
    *dst += head, *src += head, *n -= head;
    return r;
}

/* The folded 128 bits reduced to the register with two crc32 instructions. */
__attribute__((target("sse4.2"))) static inline uint32_t reduce128(__m128i x)
{
    return (uint32_t)_mm_crc32_u64(_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x)), (uint64_t)_mm_extract_epi64(x, 1));
}

/* How far ahead of its loads the fold asks for the source's lines. One sequential stream from
 * memory left the fold at ~8 GB/s on an Intel Xeon (2026-12-02: 640 MB in 0.076-0.097 s against
 * the crc32c library's 0.065-0.071 s, which reads three interleaved streams; from the cache both
 * ran at ~21 GB/s); 2-8 KB ahead all gave 0.061 s (copy + CRC 0.088 -> 0.077 s, a plain copy
 * 0.071 s). Not measured on an AMD EPYC, where the fold ran at ~23 GB/s without it. The plain
 * streaming copy (copy_avx2) gained nothing from the same hint (24 copies of 22 MB from a file's
 * mapping: 0.074-0.085 s with and without), so it has none. */
#define FOLD_PREFETCH 2048

/* 256 bytes of src into b[0..3], streamed to dst when it is not NULL (64-byte aligned). */
__attribute__((target(FOLD_TARGET))) static inline void load256(const char *src, char *dst, __m512i b[4])
{
    for (int i = 0; i < 4; i++)   /* a hint: never faults, past the end or on a page not mapped */
        _mm_prefetch(src + FOLD_PREFETCH + 64 * i, _MM_HINT_T0);
    for (int i = 0; i < 4; i++) {
        b[i] = _mm512_loadu_si512((const void *)(src + 64 * i));
        if (dst != NULL)
            _mm512_stream_si512((void *)(dst + 64 * i), b[i]);
    }
}

/* CRC-32C of src[0:n] chained on value (as crc32c.crc32c(src, value)); copies src to dst with
 * streaming stores on the way when dst is not NULL. */
__attribute__((target(FOLD_TARGET))) static uint32_t crc_fold(char *dst, const char *src, size_t n, uint32_t value)
{
    uint32_t r = crc_head(~value, &dst, &src, &n, 64);
    if (n >= 256) {
        const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)K2048_HI, (long long)K2048_LO));
        const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)K512_HI, (long long)K512_LO));
        __m512i a[4], b[4];
        load256(src, dst, a);
        /* the register enters as the first 32 bits of the message */
        a[0] = _mm512_xor_si512(a[0], _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)r), 0));
        src += 256, n -= 256;
        if (dst != NULL)
            dst += 256;
        for (; n >= 256; n -= 256, src += 256) {
            load256(src, dst, b);
            if (dst != NULL)
                dst += 256;
            for (int i = 0; i < 4; i++)
                a[i] = fold512(a[i], k2048, b[i]);
        }
        for (int i = 1; i < 4; i++)   /* the four accumulators into the last */
            a[i] = fold512(a[i - 1], k512, a[i]);
        __m128i x = _mm_xor_si128(
            _mm_xor_si128(fold128(_mm512_extracti32x4_epi32(a[3], 0), K384_LO, K384_HI),
                          fold128(_mm512_extracti32x4_epi32(a[3], 1), K256_LO, K256_HI)),
            _mm_xor_si128(fold128(_mm512_extracti32x4_epi32(a[3], 2), K128_LO, K128_HI),
                          _mm512_extracti32x4_epi32(a[3], 3)));
        r = reduce128(x);
        if (dst != NULL)
            _mm_sfence();
    }
    r = crc_bytes(r, dst, src, n);
    return ~r;
}

/* The same fold over 256-bit registers, for CPUs with VPCLMULQDQ and AVX2 but no AVX-512 (AMD
 * Zen 3, Intel client cores, VMs that hide AVX-512: the development VM of 2026-12-03, an AMD EPYC
 * whose hypervisor shows avx2 and vpclmulqdq only). Eight 32-byte accumulators take 256 bytes a
 * round, each lane moving 2048 bits forward; at the end each accumulator folds 256 bits into the
 * next and the last one's two lanes into one, reduced as above. */
#define FOLD256_TARGET "avx2,vpclmulqdq,pclmul,sse4.2"

__attribute__((target(FOLD256_TARGET))) static inline __m256i fold256(__m256i x, __m256i k, __m256i next)
{
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00),
                                             _mm256_clmulepi64_epi128(x, k, 0x11)), next);
}

/* 256 bytes of src into b[0..7], streamed to dst when it is not NULL (32-byte aligned). */
__attribute__((target(FOLD256_TARGET))) static inline void load256y(const char *src, char *dst, __m256i b[8])
{
    for (int i = 0; i < 4; i++)
        _mm_prefetch(src + FOLD_PREFETCH + 64 * i, _MM_HINT_T0);
    for (int i = 0; i < 8; i++) {
        b[i] = _mm256_loadu_si256((const __m256i *)(src + 32 * i));
        if (dst != NULL)
            _mm256_stream_si256((__m256i *)(dst + 32 * i), b[i]);
    }
}

__attribute__((target(FOLD256_TARGET))) static uint32_t crc_fold_avx2(char *dst, const char *src, size_t n,
                                                                      uint32_t value)
{
    uint32_t r = crc_head(~value, &dst, &src, &n, 32);
    if (n >= 256) {
        const __m256i k2048 = _mm256_broadcastsi128_si256(_mm_set_epi64x((long long)K2048_HI, (long long)K2048_LO));
        const __m256i k256 = _mm256_broadcastsi128_si256(_mm_set_epi64x((long long)K256_HI, (long long)K256_LO));
        __m256i a[8], b[8];
        load256y(src, dst, a);
        /* the register enters as the first 32 bits of the message */
        a[0] = _mm256_xor_si256(a[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)r)));
        src += 256, n -= 256;
        if (dst != NULL)
            dst += 256;
        for (; n >= 256; n -= 256, src += 256) {
            load256y(src, dst, b);
            if (dst != NULL)
                dst += 256;
            for (int i = 0; i < 8; i++)
                a[i] = fold256(a[i], k2048, b[i]);
        }
        for (int i = 1; i < 8; i++)   /* the eight accumulators into the last */
            a[i] = fold256(a[i - 1], k256, a[i]);
        __m128i x = _mm_xor_si128(fold128(_mm256_castsi256_si128(a[7]), K128_LO, K128_HI),
                                  _mm256_extracti128_si256(a[7], 1));
        r = reduce128(x);
        if (dst != NULL)
            _mm_sfence();
    }
    r = crc_bytes(r, dst, src, n);
    return ~r;
}
#else
#define COCI_FOLD 0
#endif
#else
#define COCI_STREAM 0
#define COCI_FOLD 0
#endif

static int have_avx2, have_fold512, have_fold256, fold_width;  /* fold_width: 512, 256 or 0 (none) */

static PyObject *stream_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: %zd bytes into a buffer of %zd", src.len, dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
#if COCI_STREAM
    if (have_avx2)
        copy_avx2((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
    else
        copy_sse2((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
#else
    memcpy(dst.buf, src.buf, (size_t)dst.len);
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyObject *crc_common(Py_buffer *dst, Py_buffer *src, unsigned long value)
{
    uint32_t crc = 0;
    if (!fold_width) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no VPCLMULQDQ with AVX2 (_stream.CRC is None): "
                                            "use the crc32c library");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
#if COCI_FOLD
    crc = (fold_width == 512 ? crc_fold : crc_fold_avx2)(dst != NULL ? (char *)dst->buf : NULL,
                                                         (const char *)src->buf, (size_t)src->len, (uint32_t)value);
#endif
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *stream_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer src;
    unsigned long value = 0;
    PyObject *out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*|k:crc32c", &src, &value))
        return NULL;
    out = crc_common(NULL, &src, value);
    PyBuffer_Release(&src);
    return out;
}

static PyObject *stream_copy_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    unsigned long value = 0;
    PyObject *out;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*|k:copy_crc32c", &dst, &src, &value))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_crc32c: %zd bytes into a buffer of %zd", src.len, dst.len);
        out = NULL;
    } else {
        out = crc_common(&dst, &src, value);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

static PyObject *crc_name(int width)
{
    return width == 512 ? PyUnicode_FromString("vpclmulqdq") : width == 256 ? PyUnicode_FromString("vpclmulqdq-avx2")
                                                                            : Py_NewRef(Py_None);
}

static PyObject *stream_set_fold(PyObject *self, PyObject *args)
{
    int width, old = fold_width;
    if (!PyArg_ParseTuple(args, "i:set_fold", &width))
        return NULL;
    if (!(width == 0 || (width == 512 && have_fold512) || (width == 256 && have_fold256))) {
        PyErr_Format(PyExc_ValueError, "set_fold: %d-bit folding does not run on this CPU", width);
        return NULL;
    }
    PyObject *name = crc_name(width);
    int rc = PyObject_SetAttrString(self, "CRC", name);
    Py_DECREF(name);
    if (rc < 0)
        return NULL;
    fold_width = width;
    return PyLong_FromLong(old);
}

static PyMethodDef methods[] = {
    {"set_fold", stream_set_fold, METH_VARARGS,
     "set_fold(width): fold over 512- or 256-bit registers, or not at all (0), where the CPU can; "
     "returns the width before. For tests of both folds on one CPU; modules that imported CRC "
     "keep the value they read."},
    {"crc32c", stream_crc32c, METH_VARARGS,
     "crc32c(buf, value=0): the CRC-32C of buf chained on value, as crc32c.crc32c (only where "
     "CRC is not None)."},
    {"copy_crc32c", stream_copy_crc32c, METH_VARARGS,
     "copy_crc32c(dst, src, value=0): copy src into dst with streaming stores and return the "
     "CRC-32C of the bytes chained on value, in one pass (only where CRC is not None)."},
    {"copy", stream_copy, METH_VARARGS,
     "copy(dst, src): copy a C-contiguous buffer into a writable one of the same length with "
     "streaming stores (plain memcpy where the CPU has none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream",
                                    "Memory copies with non-temporal stores (coci_hpc.checkpoint.rawio).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__stream(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#if COCI_STREAM
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
    have_fold256 = COCI_FOLD && have_avx2 && __builtin_cpu_supports("vpclmulqdq") &&
                   __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
    have_fold512 = have_fold256 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl");
    fold_width = have_fold512 ? 512 : have_fold256 ? 256 : 0;
    if (PyModule_AddObject(m, "CRC", crc_name(fold_width)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "STORES", have_avx2 ? "avx2" : "sse2") < 0) {
#else
    if (PyModule_AddObject(m, "CRC", Py_NewRef(Py_None)) < 0 ||
        PyModule_AddStringConstant(m, "STORES", "memcpy") < 0) {
#endif
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
