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
#else
#define COCI_STREAM 0
#endif

static int have_avx2;

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

static PyMethodDef methods[] = {
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
    if (PyModule_AddStringConstant(m, "STORES", have_avx2 ? "avx2" : "sse2") < 0) {
#else
    if (PyModule_AddStringConstant(m, "STORES", "memcpy") < 0) {
#endif
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
