/* The `detrace-fp1` kernel on the CPU: the per-row sums of detrace.digest.kernels, compiled when detrace is installed.

   out[r] = sum over c of mix(words[r * width + c] ^ colkeys[c] ^ rowkeys[r])  (mod 2**64),  start <= r < stop,

   with mix the 64-bit finalizer of MurmurHash3 (shift 33, the two multipliers below). The same bits as the
   reference, eager and compiled kernels of detrace.digest (tests/integration/test_digest.py holds them to each other).
   Compiled ahead of time, it is there from the first call of a process: no JIT to load, no compile to wait
   for. It releases the GIL, so detrace.digest.native splits the rows over Python threads. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= UINT64_C(0xFF51AFD7ED558CCD);
    x ^= x >> 33;
    x *= UINT64_C(0xC4CEB9FE1A85EC53);
    x ^= x >> 33;
    return x;
}

static inline uint64_t load(const unsigned char *at) {
    uint64_t word; /* memcpy: a view of a tensor's bytes need not be 8-byte aligned */
    memcpy(&word, at, sizeof word);
    return word;
}

/* On x86-64, an AVX2 clone beside the baseline one, picked at load time by the CPU it runs on: the compiler
   vectorizes the loop (its 64-bit multiplies included) only where AVX2 is there. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define DETRACE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DETRACE_CLONES
#endif

DETRACE_CLONES
static void sums(const unsigned char *words, Py_ssize_t width, const unsigned char *rowkeys,
                 const unsigned char *colkeys, unsigned char *out, Py_ssize_t start, Py_ssize_t stop) {
    for (Py_ssize_t r = start; r < stop; r++) {
        const unsigned char *row = words + (size_t)r * (size_t)width * 8;
        const uint64_t key = load(rowkeys + (size_t)r * 8);
        uint64_t acc = 0;
        for (Py_ssize_t c = 0; c < width; c++) {
            acc += mix(load(row + (size_t)c * 8) ^ load(colkeys + (size_t)c * 8) ^ key);
        }
        memcpy(out + (size_t)r * 8, &acc, sizeof acc);
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
    if (width < 0 || start < 0 || stop < start) {
        problem = "row_sums: width, start and stop must satisfy 0 <= width and 0 <= start <= stop";
    } else if ((width > 0 && stop > words.len / 8 / width) || rowkeys.len / 8 < stop || out.len / 8 < stop ||
               colkeys.len / 8 < width) {
        problem = "row_sums: a buffer is shorter than width, start and stop require";
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
     "row_sums(words, width, rowkeys, colkeys, out, start, stop): detrace-fp1's per-row sums of rows start..stop "
     "of words (C-contiguous uint64 rows of `width` words) into out (uint64), without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fp1", "detrace-fp1's CPU kernel, compiled at install (see _fp1.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fp1(void) { return PyModule_Create(&module); }
