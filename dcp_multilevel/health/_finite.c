/* Counting non-finite floating-point values in a buffer: the native kernel of
 * health/finite.py (which has the numpy fallback and says why this exists).
 *
 * A value is non-finite when every bit of its exponent field is set (IEEE 754
 * infinities and NaNs; float8 e4m3fn's NaN pattern likewise), so one
 * vectorizable pass of (x & mask) == mask counts them for every float width,
 * with no temporary buffer. The GIL is released: codec threads count in
 * parallel while they code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* On x86-64 with GCC or Clang, each kernel is also compiled for AVX2 and the
 * loader picks the one the CPU runs: twice the lanes per instruction, so it
 * counts faster than the SSE2 build where the bytes are in cache. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__) && \
    (defined(__clang__) || __GNUC__ >= 6)
#define KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL
#endif

#define COUNT(T)                                                   \
    KERNEL static Py_ssize_t count_##T(const T *p, Py_ssize_t n, T mask) { \
        Py_ssize_t total = 0;                                      \
        const Py_ssize_t block = 4096;                             \
        for (Py_ssize_t i = 0; i < n; i += block) {                \
            Py_ssize_t end = i + block < n ? i + block : n;        \
            uint32_t hits = 0;                                     \
            for (Py_ssize_t j = i; j < end; j++)                   \
                hits += (uint32_t)((p[j] & mask) == mask);         \
            total += hits;                                         \
        }                                                          \
        return total;                                              \
    }

COUNT(uint8_t)
COUNT(uint16_t)
COUNT(uint32_t)
COUNT(uint64_t)

static PyObject *count(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int width;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "y*iK", &buf, &width, &mask)) return NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, got %d", width);
        return NULL;
    }
    Py_ssize_t n = buf.len / width, total = 0;
    const void *p = buf.buf;
    Py_BEGIN_ALLOW_THREADS
    /* Aligned loads where the buffer allows (a tensor's storage always does);
     * an unaligned view is counted through memcpy, which compiles to a load. */
    if (((uintptr_t)p % (uintptr_t)width) == 0) {
        switch (width) {
            case 1: total = count_uint8_t((const uint8_t *)p, n, (uint8_t)mask); break;
            case 2: total = count_uint16_t((const uint16_t *)p, n, (uint16_t)mask); break;
            case 4: total = count_uint32_t((const uint32_t *)p, n, (uint32_t)mask); break;
            default: total = count_uint64_t((const uint64_t *)p, n, (uint64_t)mask); break;
        }
    } else {
        const unsigned char *b = (const unsigned char *)p;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v = 0;
            memcpy(&v, b + i * width, (size_t)width); /* little-endian hosts */
            total += (v & mask) == mask;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(total);
}

static PyMethodDef methods[] = {
    {"count", count, METH_VARARGS,
     "count(buffer, width, mask) -> values of `width` bytes whose bits include all of `mask`"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_finite", NULL, -1, methods};

PyMODINIT_FUNC PyInit__finite(void) { return PyModule_Create(&module); }
