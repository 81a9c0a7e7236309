/* The `detrace-fp2` kernel on the CPU: the per-row lane sums of detrace.digest.scheme's fp2, compiled at install.

   For rows start <= r < stop of `width` 32-bit words (width <= 1024):
     SA[r] = sum over c of mixA(w[r, c] ^ TA[c] ^ RA[r])  (mod 2**32)
     SB[r] = sum over c of mixB(w[r, c] ^ TB[c] ^ RB[r])  (mod 2**32)
     out[r] = SA[r] | SB[r] << 32
   with rowkeys[r] = RA[r] | RB[r] << 32 and colkeys = TA[0..1023] then TB[0..1023]. Every operation is on 32-bit
   lanes (xor, logical shift, multiply, add), which vector units do natively: the compiler vectorizes the loop (AVX2
   or AVX-512 clones on x86-64 Linux, picked at load time; NEON on arm64 by default), and the plain C is the
   portable fallback. The same bits as the reference, eager and Triton kernels (tests/integration/test_digest.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t mix_a(uint32_t x) {
    x ^= x >> 16;
    x *= UINT32_C(0x7FEB352D);
    x ^= x >> 15;
    x *= UINT32_C(0x846CA68B);
    x ^= x >> 16;
    return x;
}

static inline uint32_t mix_b(uint32_t x) { /* one round: a third multiply per word would cost a quarter */
    x ^= x >> 16;
    x *= UINT32_C(0x21F0AAAD);
    x ^= x >> 15;
    return x;
}

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define DETRACE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DETRACE_CLONES
#endif
/* The loop must be vectorized whatever the build's -O level (at -O2 GCC before 12 does not vectorize it, and
   scalar code is several times slower than reading memory). */
#if defined(__GNUC__) && !defined(__clang__)
#define DETRACE_VECTORIZE __attribute__((optimize("O3")))
#else
#define DETRACE_VECTORIZE
#endif

DETRACE_CLONES DETRACE_VECTORIZE
static void sums(const unsigned char *words, Py_ssize_t width, const unsigned char *rowkeys,
                 const uint32_t *colkeys, unsigned char *out, Py_ssize_t start, Py_ssize_t stop) {
    const uint32_t *ta = colkeys, *tb = colkeys + 1024;
    for (Py_ssize_t r = start; r < stop; r++) {
        const unsigned char *row = words + (size_t)r * (size_t)width * 4;
        uint64_t key;
        memcpy(&key, rowkeys + (size_t)r * 8, sizeof key);
        const uint32_t ka = (uint32_t)key, kb = (uint32_t)(key >> 32);
        uint32_t sa = 0, sb = 0;
        for (Py_ssize_t c = 0; c < width; c++) {
            uint32_t w; /* memcpy: a view of a tensor's bytes need not be 4-byte aligned */
            memcpy(&w, row + (size_t)c * 4, sizeof w);
            sa += mix_a(w ^ ta[c] ^ ka);
            sb += mix_b(w ^ tb[c] ^ kb);
        }
        const uint64_t both = (uint64_t)sa | (uint64_t)sb << 32;
        memcpy(out + (size_t)r * 8, &both, sizeof both);
    }
}

static PyObject *row_sums(PyObject *self, PyObject *args) {
    Py_buffer words, rowkeys, colkeys, out;
    Py_ssize_t width, start, stop;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ny*y*w*nn", &words, &width, &rowkeys, &colkeys, &out, &start, &stop)) {
        return NULL;
    }
    const char *problem = NULL;
    if (width < 0 || width > 1024 || start < 0 || stop < start) {
        problem = "row_sums: width, start and stop must satisfy 0 <= width <= 1024 and 0 <= start <= stop";
    } else if ((width > 0 && stop > words.len / 4 / width) || rowkeys.len / 8 < stop || out.len / 8 < stop ||
               colkeys.len < 2048 * 4 || ((uintptr_t)colkeys.buf % 4) != 0) {
        problem = "row_sums: a buffer is shorter than width, start and stop require (colkeys: 2048 aligned uint32)";
    }
    if (problem == NULL) {
        Py_BEGIN_ALLOW_THREADS
        sums(words.buf, width, rowkeys.buf, colkeys.buf, out.buf, start, stop);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&words);
    PyBuffer_Release(&rowkeys);
    PyBuffer_Release(&colkeys);
    PyBuffer_Release(&out);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"row_sums", row_sums, METH_VARARGS,
     "row_sums(words, width, rowkeys, colkeys, out, start, stop): detrace-fp2's per-row lane sums of rows "
     "start..stop of words (C-contiguous rows of `width` 32-bit words) into out (uint64), without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fp2", "detrace-fp2's CPU kernel, compiled at install (see _fp2.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fp2(void) { return PyModule_Create(&module); }
